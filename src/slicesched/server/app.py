"""The HTTP endpoint (FastAPI on uvicorn): OpenAI's completions and chat completions (model =
tenant name; `stream: true` as server-sent events), `/v1/models`, `/metrics` (Prometheus),
`/health`.

Every request body goes through one path: at most `max_body_bytes` read (413 beyond), JSON
(400 if malformed), the body's model (400 naming an unsupported or invalid parameter), the
tenant and its context window (404, 400), then a place in flight (429 with Retry-After when
full). A request whose client disconnects is cancelled, which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slicesched.server.metrics import CONTENT_TYPE
from slicesched.server.protocol import BadRequest, ChatBody, CompletionBody, parse
from slicesched.server.service import Chunk, Service

MAX_BODY_BYTES = 1 << 20
DEFAULT_CHAT_MAX_TOKENS = 256  # a chat request without max_tokens: this many, or up to the window
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks its client is still there


def make_app(service: Service, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="SliceScheduler", lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def refused(_: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = service.healthy
        body: dict = {"status": "ok" if ok else "failed", "open_requests": service.open}
        if service.workers is not None:  # the process of each device's worker (Ray actors)
            body["device_workers"] = list(service.workers.pids)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": t, "object": "model", "created": 0, "owned_by": "slicesched",
                                            "tokenizer": service.tokenizers[t].name,
                                            "max_model_len": service.limits[t]} for t in service.tenants]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse(CompletionBody, await _json(request, max_body_bytes))
        tok = service.tokenizer(body.model)
        ids = tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return await _respond(service, request, body, ids, body.max_tokens, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse(ChatBody, await _json(request, max_body_bytes))
        tok = service.tokenizer(body.model)
        ids = tok.chat([{"role": m.role, "content": m.text()} for m in body.messages])
        return await _respond(service, request, body, ids, body.max_completion_tokens or body.max_tokens,
                              "chat.completion")

    return app


def run(app: FastAPI, host: str, port: int, grace_s: float) -> None:
    """Serve `app` until SIGINT or SIGTERM; then stop accepting, let the requests in flight
    finish (up to `grace_s`), stop the serving loop, and return (exit status 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self):  # uvicorn's own re-raises the signal once stopped: status 143, not 0
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=grace_s, log_level="warning")).run()


async def _json(request: Request, limit: int) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"the request body is over {limit} bytes")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise BadRequest(413, f"the request body is over {limit} bytes")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(400, f"malformed JSON body: {e}") from None


async def _respond(service: Service, request: Request, body, ids: list[int], max_tokens: int | None,
                   kind: str) -> Response:
    default = 16 if kind == "text_completion" else DEFAULT_CHAT_MAX_TOKENS
    max_tokens = service.check(body.model, ids, max_tokens, default)
    chunks = service.generate(body.model, ids, max_tokens, body.stop)
    first = await anext(chunks)  # errors before anything is sent (429, 503) are plain responses
    head = _Head(kind, body.model, ids, body.return_token_ids)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_events(head, first, chunks, usage), media_type="text/event-stream")
    task = asyncio.ensure_future(_collect(first, chunks))
    while not task.done():  # a client gone mid-request cancels it (its KV is freed)
        await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    text, out_ids, reason = task.result()
    return JSONResponse(head.whole(text, out_ids, reason))


async def _collect(first: Chunk, chunks: AsyncIterator[Chunk]) -> tuple[str, list[int], str]:
    text, ids, c = [first.text], list(first.ids), first
    try:
        while c.finish_reason is None:
            c = await anext(chunks)
            text.append(c.text)
            ids += c.ids
    finally:
        await chunks.aclose()
    return "".join(text), ids, c.finish_reason


async def _events(head: "_Head", first: Chunk, chunks: AsyncIterator[Chunk], usage: bool) -> AsyncIterator[str]:
    n, c, opening = 0, first, True
    try:
        if head.chat:
            yield _sse(head.chunk({"role": "assistant", "content": ""}, None, None, first=True))
            opening = False
        while True:
            n += len(c.ids)
            if c.text or c.ids or c.finish_reason:
                yield _sse(head.chunk(c.text, c.ids, c.finish_reason, first=opening))
                opening = False
            if c.finish_reason is not None:
                break
            c = await anext(chunks)
        if usage:
            yield _sse({**head.base(".chunk"), "choices": [], "usage": head.usage(n)})
        yield "data: [DONE]\n\n"
    except BadRequest as e:  # the loop failed mid-stream: the client hears why
        yield _sse(e.body())
    finally:
        await chunks.aclose()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Head:
    """What every response or chunk of one request repeats, and its choice's shape."""

    def __init__(self, kind: str, model: str, prompt_ids: list[int], token_ids: bool) -> None:
        self.kind, self.model, self.prompt_ids, self.token_ids = kind, model, prompt_ids, token_ids
        self.chat = kind == "chat.completion"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def base(self, suffix: str = "") -> dict:
        kind = self.kind + suffix if self.chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n,
                "total_tokens": len(self.prompt_ids) + n}

    def _choice(self, payload: dict, ids, reason: str | None) -> dict:
        choice = {"index": 0, **payload, "finish_reason": reason}
        if self.token_ids and ids is not None:
            choice["token_ids"] = list(ids)
        return choice

    def chunk(self, content: str | dict, ids, reason: str | None, first: bool = False) -> dict:
        """A streamed chunk: `content` text (a chat delta's whole dict where given); the
        prompt's ids ride on the first chunk."""
        if self.chat:
            delta = content if isinstance(content, dict) else ({"content": content} if content or ids else {})
            choice = self._choice({"delta": delta, "logprobs": None}, ids, reason)
        else:
            choice = self._choice({"text": content, "logprobs": None}, ids, reason)
        out = {**self.base(".chunk"), "choices": [choice]}
        if self.token_ids and first:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def whole(self, text: str, ids: list[int], reason: str) -> dict:
        payload = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        out = {**self.base(), "choices": [self._choice({**payload, "logprobs": None}, ids, reason)],
               "usage": self.usage(len(ids))}
        if self.token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out
