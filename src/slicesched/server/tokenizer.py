"""Text in, token ids out, and back, for each tenant of the endpoint.

A tenant served from a local Hugging Face checkpoint uses the checkpoint's tokenizer (and its
chat template, when it has one). A random-weight tenant has no tokenizer of its own; it gets
the byte-level tokenizer: a prompt's UTF-8 bytes are its token ids (0-255), and an output id
`i` stands for the byte `i mod 256` (random weights emit ids from the whole vocabulary; the
text is then arbitrary bytes, shown with U+FFFD where they are not valid UTF-8).

Chat messages without a template become `<|role|>\\ncontent\\n` per message, then
`<|assistant|>\\n`: the same documented format for every tenant without one.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    name: str  # what the server says at start: "byte-level" or the checkpoint folder
    eos_ids: frozenset[int]  # ids that end a request (not delivered)

    def encode(self, text: str) -> list[int]: ...

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def stream(self) -> "TextStream": ...


class TextStream(Protocol):
    """Incremental decoding: the text of the ids added so far, a piece at a time, never a
    partial character (held back until complete, or flushed by `end`)."""

    def add(self, ids: Sequence[int]) -> str: ...

    def end(self) -> str: ...


def template_chat(messages: Sequence[dict[str, str]]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """One token per UTF-8 byte; output id i decodes to byte i mod 256."""

    name: str = "byte-level"
    eos_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(template_chat(messages))

    def stream(self) -> "_ByteStream":
        return _ByteStream()


class _ByteStream:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Sequence[int]) -> str:
        return self._dec.decode(bytes(i % 256 for i in ids))

    def end(self) -> str:
        return self._dec.decode(b"", final=True)


class HFTokenizer:
    """A checkpoint's own tokenizer (`transformers.AutoTokenizer`, offline)."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.name = folder
        self._tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        eos = self._tok.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # an encoding, or the ids
        return self.encode(template_chat(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def stream(self) -> "_DiffStream":
        return _DiffStream(self)


class _DiffStream:
    """Decodes all ids each time and gives what is new; text ending in U+FFFD is held back
    (a multi-byte character split over tokens) until more ids complete it or the stream ends."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok, self._ids, self._given = tok, [], 0

    def add(self, ids: Sequence[int]) -> str:
        self._ids += ids
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def end(self) -> str:
        return self._take(self._tok.decode(self._ids))

    def _take(self, text: str) -> str:
        new, self._given = text[self._given:], max(self._given, len(text))
        return new


def tokenizer_for(checkpoint: str | None) -> Tokenizer:
    """The checkpoint's tokenizer where the folder has one, else the byte-level tokenizer."""
    if checkpoint is not None and any((Path(checkpoint) / f).is_file()
                                      for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return HFTokenizer(checkpoint)
    return ByteTokenizer()
