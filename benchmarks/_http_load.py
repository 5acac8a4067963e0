"""`python benchmarks/http.py`: the HTTP endpoint under load: `slicesched serve` started as a user starts it, driven over
loopback by concurrent streaming clients for a bounded time, then stopped with SIGTERM.

    python benchmarks/http.py [--clients 8] [--seconds 20] [--scheduler slicesched] [--scenario FILE]

Prints one figure per line as `name: value unit`. The scenario is `scenarios/loans_cpu.toml`
(three scaled-down random-weight tenants, one CPU executor device each). Each client thread
sends streaming completions back to back (tenant, prompt length and max_tokens drawn from a
seeded generator: prompts of 20-400 bytes, 8-64 output tokens) until the time is up; a request
counts as an error unless it answers 200 and streams every token it asked for, then [DONE].
TTFT is measured by the client: from sending the request to the first chunk carrying tokens.
The clients share the machine's cores with the server, so the figures are those of a loaded
host, not of the server alone (`load_avg_1m` says how loaded).

Figures of `--scheduler` (default slicesched): `http_requests_per_s` (completed requests over
the load's wall time), `http_output_tokens_per_s`, `http_ttft_p50_s`, `http_ttft_p99_s`,
`http_errors`, `http_requests`, `http_stop_s` (SIGTERM to exit, the streams in flight finishing
first), `http_exit_status`; the same of `--reference` (default dedicated, run first, the same
load) as `http_<reference>_...`, and `http_requests_per_s_vs_<reference>`,
`http_ttft_p50_s_vs_<reference>` (ratios: the host's load moves both alike).

With Ray (`--ray`, the default; `--no-ray` skips it): the same load on `--scheduler` served with
each device's models in a Ray actor process of its own (`serve --ray-address local`):
`http_ray_requests_per_s`, `http_ray_ttft_p50_s`, `http_ray_ttft_p99_s`, `http_ray_errors`, ...,
and `http_ray_requests_per_s_vs_in_process`; then once more with device 0's worker killed a third
of the way in (the process `/health` names): `http_fault_lost_requests` (requests that did not
stream every token they asked for, then [DONE]), `http_fault_requests_hit` (requests on the
device when it died), `http_fault_resume_s` and `http_fault_recovery_s` (the server's: from the
fault's detection until the first, and every, request it hit made progress again, read from
`/metrics` before SIGTERM; NaN: not within the run), `http_fault_detect_s` (kill to detection:
`slicesched_faults` turning 1, polled every 0.1 s) and `http_fault_ttft_p99_s`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over the lazy dog while many models share one cluster".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(port: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not come up (exit status {proc.poll()})")


def _one(port: int, tenant: str, prompt: str, max_tokens: int) -> tuple[float | None, int, bool]:
    """(TTFT, tokens streamed, ok) of one streaming completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    try:
        body = {"model": tenant, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "return_token_ids": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return None, 0, False
        ttft, n, done = None, 0, False
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            ids = json.loads(data)["choices"][0].get("token_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(ids)
        return ttft, n, done and n == max_tokens
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return None, 0, False
    finally:
        conn.close()


def _client(port: int, tenants: list[str], seed: int, until: float, out: list) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < until:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 80)))[:400]
        out.append(_one(port, rng.choice(tenants), prompt, rng.randint(8, 64)))


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read()


def _gauge(port: int, name: str) -> float:
    """A gauge of the server's /metrics (NaN if absent)."""
    for line in _get(port, "/metrics").decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def _kill_worker(port: int, at: float, fault: dict) -> None:
    """At `at`, kill device 0's worker process; then time until the server reports the fault."""
    time.sleep(max(0.0, at - time.perf_counter()))
    pid = json.loads(_get(port, "/health"))["device_workers"][0]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.perf_counter()
    while time.perf_counter() - t_kill < 60 and not _gauge(port, "slicesched_faults") >= 1:
        time.sleep(0.1)
    fault["detect_s"] = time.perf_counter() - t_kill


def drive(scenario: Path, scheduler: str, clients: int, seconds: float, ray: bool = False,
          kill: bool = False) -> dict[str, float]:
    """Start `slicesched serve` (`ray`: device workers on a local Ray cluster), load it for
    `seconds` (`kill`: device 0's worker killed a third of the way in), stop it with SIGTERM."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "slicesched.cli", "serve", str(scenario), "--scheduler",
                             scheduler, "--port", str(port), "--grace-s", "60",
                             *(["--ray-address", "local"] if ray else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    fault: dict[str, float] = {}
    try:
        _wait_up(port, proc)
        tenants = [m["id"] for m in json.loads(_get(port, "/v1/models"))["data"]]
        results: list[tuple[float | None, int, bool]] = []
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_client, args=(port, tenants, i, t0 + seconds, results))
                   for i in range(clients)]
        if kill:
            threads.append(threading.Thread(target=_kill_worker, args=(port, t0 + seconds / 3, fault)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if kill:
            for k in ("fault_requests", "fault_resume_s", "fault_recovery_s"):
                fault[k] = _gauge(port, f"slicesched_{k}")
        t_stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=120)
        stop_s = time.perf_counter() - t_stop
    finally:
        if proc.poll() is None:
            proc.kill()
    ok = [r for r in results if r[2]]
    ttft = np.array([r[0] for r in ok if r[0] is not None])
    return {"requests": len(results), "requests_per_s": len(ok) / wall,
            "output_tokens_per_s": sum(r[1] for r in ok) / wall,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else float("nan"),
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
            "errors": len(results) - len(ok), "stop_s": stop_s, "exit_status": status, **fault}


UNITS = {"requests": "requests", "requests_per_s": "requests/s", "output_tokens_per_s": "tokens/s",
         "ttft_p50_s": "s", "ttft_p99_s": "s", "errors": "requests", "stop_s": "s", "exit_status": "",
         "detect_s": "s", "fault_requests": "requests", "fault_resume_s": "s", "fault_recovery_s": "s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--scheduler", default="slicesched")
    ap.add_argument("--reference", default="dedicated", help="the scheduler run beside it, for ratios ('' : none)")
    ap.add_argument("--scenario", type=Path, default=ROOT / "scenarios" / "loans_cpu.toml")
    ap.add_argument("--ray", action=argparse.BooleanOptionalAction, default=True,
                    help="also serve on Ray device workers, and once with a worker killed")
    args = ap.parse_args()
    print(f"# scheduler {args.scheduler}, reference {args.reference or 'none'}, scenario {args.scenario.name}")
    print(f"http_clients: {args.clients} clients")
    ref = drive(args.scenario, args.reference, args.clients, args.seconds) if args.reference else None
    got = drive(args.scenario, args.scheduler, args.clients, args.seconds)
    for k, v in got.items():
        print(f"http_{k}: {v:.4g} {UNITS[k]}".rstrip())
    if ref is not None:
        for k, v in ref.items():
            print(f"http_{args.reference}_{k}: {v:.4g} {UNITS[k]}".rstrip())
        for k in ("requests_per_s", "ttft_p50_s"):
            if ref[k] > 0:
                print(f"http_{k}_vs_{args.reference}: {got[k] / ref[k]:.3f} x")
    if args.ray:
        _ray_figures(args, got)
    print(f"load_avg_1m: {os.getloadavg()[0]:.2f}")


def _ray_figures(args: argparse.Namespace, in_process: dict[str, float]) -> None:
    on_ray = drive(args.scenario, args.scheduler, args.clients, args.seconds, ray=True)
    for k, v in on_ray.items():
        print(f"http_ray_{k}: {v:.4g} {UNITS[k]}".rstrip())
    if in_process["requests_per_s"] > 0:
        print(f"http_ray_requests_per_s_vs_in_process: {on_ray['requests_per_s'] / in_process['requests_per_s']:.3f} x")
    hit = drive(args.scenario, args.scheduler, args.clients, args.seconds, ray=True, kill=True)
    print(f"http_fault_lost_requests: {hit['errors']} requests")
    print(f"http_fault_requests_hit: {hit.get('fault_requests', float('nan')):.4g} requests")
    for k in ("detect_s", "fault_resume_s", "fault_recovery_s"):
        print(f"http_fault_{k.removeprefix('fault_')}: {hit.get(k, float('nan')):.4g} s")
    print(f"http_fault_ttft_p99_s: {hit['ttft_p99_s']:.4g} s")
    print(f"http_fault_requests: {hit['requests']} requests")


if __name__ == "__main__":
    main()
