"""The OpenAI completions and chat completions request bodies the endpoint accepts, and its
error body. Parameters outside these models are refused by name (`extra="forbid"`), not
ignored: a client asking for sampling, log-probabilities or several choices learns at once that
it would not get them. Decoding is greedy: `temperature` may be absent or 0, `top_p` absent or
1, `n` absent or 1. `return_token_ids` (as vLLM names it) adds the prompt's and the output's
token ids to the response.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
_ONLY = {"temperature": (0, ": this server decodes greedily"), "top_p": (1, ": this server decodes greedily"),
         "n": (1, "")}  # parameter -> the one value accepted, and why


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list once validated
    seed: int | None = None  # greedy decoding is deterministic anyway: accepted, not needed
    user: str | None = None
    return_token_ids: bool = False

    @field_validator("temperature", "top_p", "n")
    @classmethod
    def _only(cls, v: float | None, info: ValidationInfo) -> float | None:
        allowed, why = _ONLY[info.field_name]
        if v not in (None, allowed):
            raise ValueError(f"only {allowed} is supported{why}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop sequences")
        return stops


class CompletionBody(_Body):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = 16  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


class BadRequest(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def parse(kind: type[_Body], obj: object) -> _Body:
    """The request body as `kind`, or `BadRequest` naming the first field at fault."""
    try:
        return kind.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise BadRequest(400, f"unsupported parameter: {param}", param) from None
        if err["type"] == "missing":
            raise BadRequest(400, f"missing required parameter: {param}", param) from None
        raise BadRequest(400, f"invalid {param}: {err['msg'].removeprefix('Value error, ')}", param) from None
