"""The OpenAI-compatible endpoint, driven by the real `openai` client and by raw HTTP on
loopback: the tokens of offline greedy generation for random-weight tenants (byte-level
tokenizer) and for a local checkpoint with its own tokenizer; every bad request its 4xx with
the server still answering; a full server 429; a client gone frees its request's KV."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from real_helpers import TWO
from scenario_helpers import scenario
from server_helpers import serving, tiny_checkpoint
from slicesched.executor.serving import greedy_reference
from slicesched.replay.real import real_setup, tenant_model
from slicesched.server.app import make_app
from slicesched.server.service import Service

BODY_LIMIT = 4096


def _scenario(folder):
    text = TWO.replace("devices_per_node = 2", "devices_per_node = 3") + f"""
    [[tenants]]
    name = "c"
    model = "{folder}"
    max_batch_tokens = 64
    [[streams]]
    source = "synthetic"
    tenants = ["c"]
    rate = 2.0
    prompt_mean = 20
    output_mean = 4
    """
    return scenario(text)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def sc(checkpoint):
    return _scenario(checkpoint)


@pytest.fixture(scope="module")
def server(sc, tmp_path_factory):
    service = Service.build(sc, "slicesched", tmp_path_factory.mktemp("served"))
    with serving(make_app(service, max_body_bytes=BODY_LIMIT)) as url:
        yield service, url


@pytest.fixture(scope="module")
def offline(sc, checkpoint, tmp_path_factory):
    """Each tenant's model and tokenizer as offline generation has them, built apart from the server."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    setup = real_setup(sc, tmp_path_factory.mktemp("offline"))
    models = {t: tenant_model(setup, t, "cpu") for t in ("a", "b")}
    models["c"] = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return models, AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=60)


def _bytes_text(ids) -> str:
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def _until_eos(ids, eos: int):
    return ids[:ids.index(eos)] if eos in ids else ids


def test_a_completion_has_the_tokens_and_text_of_offline_generation(client, offline):
    r = client.completions.create(model="a", prompt="Hello, world", max_tokens=7, extra_body={"return_token_ids": True})
    prompt = list("Hello, world".encode())
    ref = greedy_reference(offline[0]["a"], tuple(prompt), 7)
    choice = r.choices[0]
    assert r.model_extra["prompt_token_ids"] == prompt and tuple(choice.model_extra["token_ids"]) == ref
    assert choice.text == _bytes_text(ref) and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 7)


def test_a_streamed_chat_has_the_tokens_of_offline_generation(client, offline):
    stream = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi there"}],
                                            max_tokens=9, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    chunks = list(stream)
    prompt = list("<|user|>\nhi there\n<|assistant|>\n".encode())
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].model_extra["prompt_token_ids"] == prompt and chunks[0].choices[0].delta.role == "assistant"
    assert tuple(ids) == greedy_reference(offline[0]["b"], tuple(prompt), 9) and text == _bytes_text(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9 and len([c for c in chunks if c.choices]) >= 9


def test_a_checkpoint_tenant_uses_its_weights_and_tokenizer(client, offline):
    models, tok = offline
    r = client.completions.create(model="c", prompt="the quick brown fox", max_tokens=12,
                                  extra_body={"return_token_ids": True})
    prompt = tok.encode("the quick brown fox")
    ref = _until_eos(greedy_reference(models["c"], tuple(prompt), 12), tok.eos_token_id)
    assert r.model_extra["prompt_token_ids"] == prompt
    assert tuple(r.choices[0].model_extra["token_ids"]) == ref
    assert r.choices[0].text == tok.decode(list(ref), skip_special_tokens=True)
    assert r.choices[0].finish_reason == ("stop" if len(ref) < 12 else "length")


def test_a_checkpoint_tenant_streams_chat_through_its_template(client, offline):
    models, tok = offline
    stream = client.chat.completions.create(model="c", messages=[{"role": "user", "content": "hello world"}],
                                            max_tokens=10, stream=True, extra_body={"return_token_ids": True})
    chunks = list(stream)
    prompt = tok.encode("<s>user: hello world\nassistant:", add_special_tokens=False)
    ref = _until_eos(greedy_reference(models["c"], tuple(prompt), 10), tok.eos_token_id)
    ids = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []]
    assert chunks[0].model_extra["prompt_token_ids"] == prompt and tuple(ids) == ref
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tok.decode(list(ref), skip_special_tokens=True)


def test_a_stop_sequence_cuts_the_text_before_it(client, offline):
    models, tok = offline
    prompt = tok.encode("serving many")
    full = tok.decode(list(_until_eos(greedy_reference(models["c"], tuple(prompt), 30), tok.eos_token_id)),
                      skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert len(full) >= 4 and stop
    r = client.completions.create(model="c", prompt="serving many", max_tokens=30, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def _post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _js(**kw) -> bytes:
    return json.dumps(kw).encode()


@pytest.mark.parametrize("body, status, param, words", [
    (b'{"model": "a", "prompt": "x"', 400, None, "malformed JSON"),
    (_js(model="nope", prompt="x"), 404, "model", "does not exist"),
    (_js(model="c", prompt=[5] * 600), 400, "prompt", "maximum context length is 512"),
    (_js(model="a", prompt="x", max_tokens=0), 400, "max_tokens", "at least 1"),
    (_js(model="a", prompt="x", max_tokens=-3), 400, "max_tokens", "at least 1"),
    (_js(model="a", prompt="x", max_tokens=8192), 400, "max_tokens", "maximum context length"),
    (_js(model="a", prompt="x", logprobs=3), 400, "logprobs", "unsupported parameter"),
    (_js(model="a", prompt="x", temperature=0.8), 400, "temperature", "greedily"),
    (_js(model="a", prompt="x", n=2), 400, "n", "only 1"),
    (_js(model="a", prompt=[1, 99999]), 400, "prompt", "token ids must be in"),
    (_js(model="a"), 400, "prompt", "missing required parameter"),
    (_js(model="a", prompt="x" * BODY_LIMIT), 413, None, "over 4096 bytes"),
])
def test_a_bad_request_gets_its_4xx_and_the_server_answers_the_next(server, body, status, param, words):
    url = server[1]
    got, _, err = _post(url, "/v1/completions", body)
    assert got == status and err["error"]["param"] == param and words in err["error"]["message"]
    ok, _, good = _post(url, "/v1/completions", _js(model="a", prompt="fine", max_tokens=2))
    assert ok == 200 and good["usage"]["completion_tokens"] == 2


def test_a_bad_chat_message_names_the_field(server):
    got, _, err = _post(server[1], "/v1/chat/completions", _js(model="b", messages=[{"role": "wizard", "content": "x"}]))
    assert got == 400 and err["error"]["param"] == "messages.0.role"


def _open_stream(url: str, tenant: str, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", _js(model=tenant, prompt="go on", max_tokens=max_tokens, stream=True),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_full_server_answers_429_with_retry_after(server):
    service, url = server
    service.max_open = 1
    conn = None
    try:
        conn, resp = _open_stream(url, "a", 4000)
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        got, headers, err = _post(url, "/v1/completions", _js(model="b", prompt="x", max_tokens=2))
        assert got == 429 and headers["retry-after"] == "1" and err["error"]["type"] == "rate_limit_error"
    finally:
        service.max_open = 256
        if conn is not None:
            conn.close()


def _cancelled(url: str, tenant: str) -> float:
    return _metrics(url).get(("slicesched_requests_total", (("reason", "cancelled"), ("tenant", tenant))), 0.0)


def _assert_cancelled_and_freed(url: str, tenant: str, before: float) -> None:
    """Within 5 s /metrics counts one more cancelled request of `tenant` and no KV block in use
    (the request would otherwise run thousands of tokens longer)."""
    kv = ("slicesched_kv_blocks_used", (("tenant", tenant),))
    end, m = time.monotonic() + 5, {}
    while time.monotonic() < end:
        m = _metrics(url)
        if _cancelled(url, tenant) > before and m[kv] == 0:
            break
        time.sleep(0.1)
    assert _cancelled(url, tenant) == before + 1 and m[kv] == 0


def test_a_client_that_disconnects_mid_stream_has_its_request_cancelled_and_kv_freed(server):
    url = server[1]
    before = _cancelled(url, "a")
    conn, resp = _open_stream(url, "a", 4000)
    assert resp.readline().startswith(b"data: ")
    time.sleep(0.3)  # a snapshot taken while it runs
    assert _metrics(url)[("slicesched_kv_blocks_used", (("tenant", "a"),))] > 0
    conn.close()
    _assert_cancelled_and_freed(url, "a", before)


def test_metrics_count_what_was_served(server, client):
    url = server[1]
    before = _metrics(url)
    client.completions.create(model="b", prompt="count me", max_tokens=3)
    after = _metrics(url)
    n = ("slicesched_ttft_seconds_count", (("tenant", "b"),))
    tokens = ("slicesched_generated_tokens_total", (("tenant", "b"),))
    assert after[n] == before.get(n, 0) + 1 and after[tokens] == before.get(tokens, 0) + 3
    assert ("slicesched_device_busy_share", (("device", "1"),)) in after


def test_models_and_health(server):
    url = server[1]
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        models = json.loads(r.read())["data"]
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert [m["id"] for m in models] == ["a", "b", "c"] and models[2]["max_model_len"] == 512
    assert models[0]["tokenizer"] == "byte-level" and health["status"] == "ok"


def test_a_client_that_disconnects_before_a_whole_response_has_its_request_cancelled(server):
    url = server[1]
    before = _cancelled(url, "b")
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", _js(model="b", prompt="go on", max_tokens=6000),
                 {"Content-Type": "application/json"})
    time.sleep(0.5)  # running, not answered yet
    conn.close()
    _assert_cancelled_and_freed(url, "b", before)
