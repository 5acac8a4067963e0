"""`slicesched serve` as a user runs it: SIGTERM with streams in flight lets every one of them
finish (all their tokens, then [DONE]) before the process exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

from real_helpers import TWO
from server_helpers import free_port

TOKENS = 300


def _stream(port: int, tenant: str, got: dict, first: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": tenant, "prompt": "keep going", "max_tokens": TOKENS, "stream": True, "return_token_ids": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines = []
    for line in resp:
        if line.startswith(b"data: "):
            lines.append(line[6:].strip())
            first.set()
    got[tenant] = lines
    conn.close()


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the server did not come up (exit {proc.poll()})")


def test_sigterm_finishes_the_streams_in_flight_then_exits_0(tmp_path):
    path = tmp_path / "two.toml"
    path.write_text(textwrap.dedent(TWO))
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "slicesched.cli", "serve", str(path), "--port", str(port),
                             "--grace-s", "60"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, proc)
        got, started, threads = {}, [], []
        for tenant in ("a", "b"):
            first = threading.Event()
            threads.append(threading.Thread(target=_stream, args=(port, tenant, got, first)))
            started.append(first)
            threads[-1].start()
        assert all(f.wait(60) for f in started)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    for tenant in ("a", "b"):
        lines = got[tenant]
        chunks = [json.loads(x) for x in lines[:-1]]
        assert lines[-1] == b"[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0].get("token_ids", [])) for c in chunks) == TOKENS
