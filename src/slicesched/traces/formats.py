"""Loaders for the request-level trace formats the project replays.

Each loader takes a path (and an optional trace ``name``, default the file stem) and returns
a :class:`Trace`; malformed content raises ``InputError`` with file, line and field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import chain
from pathlib import Path

import numpy as np
import pandas as pd

from slicesched.errors import InputError
from slicesched.traces._validate import (
    Lines, fail_at, float_column, int_column, line_of, read_text_table, timestamp_column)
from slicesched.traces.registry import register_trace_format
from slicesched.traces.request import Trace

__all__ = ["load_azure", "load_mooncake", "load_burstgpt", "load_plain_csv"]

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
CSV_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


def _header_starts(prefix: str) -> Callable[[str], bool]:
    return lambda line: line.lstrip("\ufeff").startswith(prefix)


@register_trace_format("azure", sniff=_header_starts(",".join(AZURE_COLUMNS)))
def load_azure(path: Path, *, name: str | None = None) -> Trace:
    """Azure LLM inference trace 2023 (Splitwise): ``TIMESTAMP,ContextTokens,GeneratedTokens``.

    TIMESTAMP is wall-clock with 7 fractional digits; arrivals are seconds after the earliest
    request. There are no tenant labels.
    """
    df = read_text_table(path, required=AZURE_COLUMNS)
    arrival = timestamp_column(df, "TIMESTAMP", path=path, first_line=2)
    prompt = int_column(df, "ContextTokens", path=path, first_line=2, tokens=True)
    output = int_column(df, "GeneratedTokens", path=path, first_line=2, tokens=True)
    return Trace.from_columns(name or path.stem, arrival, prompt, output)


@register_trace_format("burstgpt", sniff=_header_starts(",".join(BURSTGPT_COLUMNS)))
def load_burstgpt(path: Path, *, name: str | None = None) -> Trace:
    """BurstGPT CSV: ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``.

    Timestamp is in seconds; arrivals are rebased to the first kept request. ``Model``
    (ChatGPT or GPT-4) becomes the tenant. Rows with ``Response tokens`` = 0 are failed
    requests in BurstGPT and are **dropped** (after validation, so line numbers in errors
    still refer to the file).
    """
    df = read_text_table(path, required=BURSTGPT_COLUMNS)
    arrival = float_column(df, "Timestamp", path=path, first_line=2)
    prompt = int_column(df, "Request tokens", path=path, first_line=2, tokens=True)
    output = int_column(df, "Response tokens", path=path, first_line=2)
    model = df["Model"].to_numpy(dtype=object)
    fail_at(df, "Model", model == "", "a model name", path=path, first_line=2)
    ok = output > 0
    arrival = arrival[ok] - (arrival[ok].min() if ok.any() else 0.0)
    return Trace.from_columns(name or path.stem, arrival, prompt[ok], output[ok], model[ok])


@register_trace_format("csv", extensions=(".csv",), sniff=_header_starts("arrival_s,"))
def load_plain_csv(path: Path, *, name: str | None = None) -> Trace:
    """The project's own CSV: ``arrival_s,prompt_tokens,output_tokens[,tenant]``.

    Arrivals are kept as written (seconds, non-negative; rows may be in any order). An empty
    tenant field means no tenant.
    """
    df = read_text_table(path, required=CSV_COLUMNS)
    arrival = float_column(df, "arrival_s", path=path, first_line=2)
    prompt = int_column(df, "prompt_tokens", path=path, first_line=2, tokens=True)
    output = int_column(df, "output_tokens", path=path, first_line=2, tokens=True)
    tenant = None
    if "tenant" in df.columns:
        raw = df["tenant"].to_numpy(dtype=object)
        tenant = np.where(raw == "", None, raw)
    return Trace.from_columns(name or path.stem, arrival, prompt, output, tenant)


def _looks_like_mooncake(line: str) -> bool:
    return line.startswith("{") and '"input_length"' in line


@register_trace_format("mooncake", extensions=(".jsonl",), sniff=_looks_like_mooncake)
def load_mooncake(path: Path, *, name: str | None = None) -> Trace:
    """Mooncake FAST'25 JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``.

    ``timestamp`` is milliseconds since the trace start and is kept as is (converted to
    seconds). ``hash_ids`` (512-token prefix block hashes; optional, default none) become
    ``prefix_hashes``. Blank lines are skipped.
    """
    records, lines = _read_json_lines(path)
    df = pd.DataFrame.from_records(records, columns=["timestamp", "input_length",
                                                     "output_length", "hash_ids"])
    arrival = float_column(df, "timestamp", path=path, first_line=lines) / 1000.0
    prompt = int_column(df, "input_length", path=path, first_line=lines, tokens=True)
    output = int_column(df, "output_length", path=path, first_line=lines, tokens=True)
    hashes = _hash_tuples(df["hash_ids"].tolist(), path, lines)
    return Trace.from_columns(name or path.stem, arrival, prompt, output,
                              prefix_hashes=hashes)


def _read_json_lines(path: Path) -> tuple[list[dict[str, object]], np.ndarray]:
    """Parse non-blank lines as JSON objects; return them and their 1-based line numbers."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("no such trace file", file=str(path)) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text ({e.reason})", file=str(path)) from None
    numbered = [(i, s) for i, s in enumerate(text.splitlines(), start=1) if s.strip()]
    records: list[dict[str, object]] = []
    for lineno, s in numbered:
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise InputError(f"not valid JSON ({e.msg})", file=str(path), line=lineno) from None
        if not isinstance(obj, dict):
            raise InputError("expected a JSON object", file=str(path), line=lineno)
        records.append(obj)
    return records, np.fromiter((i for i, _ in numbered), dtype=np.int64, count=len(numbered))


def _hash_tuples(values: list[object], path: Path, lines: Lines) -> list[tuple[int, ...]]:
    """Validate ``hash_ids`` (a list of non-negative ints, or absent) and make tuples."""
    lists = [[] if v is None or (isinstance(v, float) and np.isnan(v)) else v for v in values]
    flat = list(chain.from_iterable(v for v in lists if isinstance(v, list)))
    ok_types = all(isinstance(v, list) for v in lists)
    arr = np.asarray(flat)
    if ok_types and (arr.size == 0 or (arr.dtype.kind == "i" and arr.min() >= 0)):
        return [tuple(v) for v in lists]
    for i, v in enumerate(lists):  # slow path only to locate the bad row
        if not (isinstance(v, list) and all(type(h) is int and h >= 0 for h in v)):
            raise InputError(f"expected a list of non-negative integers, got {v!r:.60}",
                             file=str(path), line=line_of(lines, i), field="hash_ids")
    raise AssertionError("unreachable")  # pragma: no cover
