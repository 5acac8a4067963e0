"""Vectorised parsing and validation of tabular trace files.

Every column is read as text, converted in one pandas call, and only if the conversion finds
a bad value do we locate the first one, so good files pay almost nothing for validation and
bad ones get an ``InputError`` with file, 1-based line and field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from slicesched.errors import InputError

__all__ = ["Lines", "read_text_table", "int_column", "float_column", "timestamp_column",
           "fail_at", "line_of"]

_PARSER_LINE = re.compile(r"line (\d+)")


def read_text_table(path: Path, *, required: Sequence[str] = (),
                    names: Sequence[str] | None = None) -> pd.DataFrame:
    """Read a CSV as strings, every line kept so row ``i`` is file line ``i + first``.

    With ``names`` the file has no header (row 0 is line 1); otherwise row 0 is line 2 and
    ``required`` header columns must be present. Trailing blank lines are dropped; blank lines
    inside the file stay as rows of empty strings, which the column checks then report.
    """
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False,
                         header=None if names else 0, names=names)
    except FileNotFoundError:
        raise InputError("no such trace file", file=str(path)) from None
    except pd.errors.EmptyDataError:
        raise InputError("the file is empty", file=str(path)) from None
    except pd.errors.ParserError as e:
        m = _PARSER_LINE.search(str(e))
        raise InputError(f"wrong number of fields ({str(e).split('C error: ')[-1]})",
                         file=str(path), line=int(m.group(1)) if m else None) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text ({e.reason})", file=str(path)) from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise InputError(f"header lacks column(s) {', '.join(missing)}; found "
                         f"{', '.join(map(str, df.columns))}", file=str(path), line=1,
                         field=missing[0])
    return _drop_trailing_blank_rows(df)


def _drop_trailing_blank_rows(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df
    blank = (df == "").all(axis=1).to_numpy()
    keep = len(blank) - int(np.argmin(blank[::-1])) if not blank.all() else 0
    return df.iloc[:keep]


Lines = int | np.ndarray
"""Where rows sit in the file: the line of row 0 (rows on consecutive lines) or one line
number per row (formats that skip blank lines)."""


def line_of(lines: Lines, i: int) -> int:
    """The 1-based file line of row ``i``."""
    return lines + i if isinstance(lines, int) else int(lines[i])


def fail_at(df: pd.DataFrame, col: str, bad: np.ndarray, expected: str, *, path: Path,
            first_line: Lines) -> None:
    """Raise InputError for the first ``True`` in ``bad`` (no-op when there is none)."""
    hits = np.flatnonzero(bad)
    if hits.size:
        i = int(hits[0])
        value = df[col].iloc[i]
        got = "nothing (field missing)" if _is_missing(value) else repr(value)
        raise InputError(f"expected {expected}, got {got}", file=str(path),
                         line=line_of(first_line, i), field=col)


def _is_missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


#: Most tokens one request may have in a trace (the longest in the shipped traces is ~191k).
MAX_TRACE_TOKENS = 1 << 20


def int_column(df: pd.DataFrame, col: str, *, path: Path, first_line: Lines, tokens: bool = False) -> np.ndarray:
    """Column ``col`` as int64, each value a non-negative integer (``12.0`` and ``1e3`` pass);
    with ``tokens``, a token count from 1 (a request with no prompt or no output cannot be
    served) to ``MAX_TRACE_TOKENS``."""
    v = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    lo, hi = (1, MAX_TRACE_TOKENS) if tokens else (0, np.inf)
    bad = ~np.isfinite(v) | (v < lo) | (v > hi) | (v != np.floor(v))
    what = f"a token count from 1 to {MAX_TRACE_TOKENS:,}" if tokens else "a non-negative integer"
    fail_at(df, col, bad, what, path=path, first_line=first_line)
    return v.astype(np.int64)


def float_column(df: pd.DataFrame, col: str, *, path: Path, first_line: Lines) -> np.ndarray:
    """Column ``col`` as float64, each value finite and non-negative."""
    v = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    fail_at(df, col, ~np.isfinite(v) | (v < 0), "a non-negative number", path=path,
            first_line=first_line)
    return v


def timestamp_column(df: pd.DataFrame, col: str, *, path: Path, first_line: Lines) -> np.ndarray:
    """Wall-clock strings (ISO 8601, any number of fractional digits) as seconds from the
    earliest one, float64 with nanosecond resolution kept until the subtraction."""
    ts = pd.to_datetime(df[col], format="ISO8601", errors="coerce")
    fail_at(df, col, ts.isna().to_numpy(), "a timestamp like '2023-11-16 18:15:46.6805900'",
            path=path, first_line=first_line)
    ns = ts.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    return (ns - ns.min()).astype(np.float64) / 1e9 if ns.size else ns.astype(np.float64)
