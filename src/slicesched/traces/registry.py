"""Registry of trace file formats, so scenarios name a format and outside packages add their own.

A format is a loader ``(path, **kw) -> Trace`` plus how to recognise its files (extensions
and a test on the first line). Outside packages register formats through the entry-point
group ``slicesched.trace_formats`` (each entry point names a module or callable that, when
loaded, registers its formats); they are loaded once, the first time a format is looked up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

from slicesched.errors import InputError
from slicesched.traces.request import Trace

__all__ = ["TraceFormat", "register_trace_format", "load_trace", "trace_formats",
           "get_trace_format"]

ENTRY_POINT_GROUP = "slicesched.trace_formats"


class TraceLoader(Protocol):
    def __call__(self, path: Path, /, **kw: Any) -> Trace: ...


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """A registered format: its loader and how ``load_trace`` sniffs its files."""

    name: str
    loader: TraceLoader
    extensions: tuple[str, ...] = ()
    sniff: Callable[[str], bool] | None = None


_FORMATS: dict[str, TraceFormat] = {}
_entry_points_loaded = False


def register_trace_format(name: str, *, extensions: tuple[str, ...] = (),
                          sniff: Callable[[str], bool] | None = None
                          ) -> Callable[[TraceLoader], TraceLoader]:
    """Decorator registering a loader under ``name``.

    ``extensions`` (like ``".jsonl"``) and ``sniff(first_line) -> bool`` let ``load_trace``
    pick the format when none is named. A second registration of a name raises ValueError:
    silently replacing a loader would change what every scenario using that name reads.
    """
    def decorate(loader: TraceLoader) -> TraceLoader:
        if name in _FORMATS:
            raise ValueError(f"trace format {name!r} is already registered")
        _FORMATS[name] = TraceFormat(name, loader, tuple(e.lower() for e in extensions), sniff)
        return loader
    return decorate


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def trace_formats() -> tuple[str, ...]:
    """Names of all registered formats, sorted."""
    _load_entry_points()
    return tuple(sorted(_FORMATS))


def get_trace_format(name: str) -> TraceFormat:
    """The format registered as ``name``; InputError (field ``format``) if there is none."""
    _load_entry_points()
    try:
        return _FORMATS[name]
    except KeyError:
        raise InputError(f"unknown trace format {name!r}; known: {', '.join(trace_formats())}",
                         field="format") from None


def _first_line(path: Path) -> str:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        return f.readline().strip()


def _sniff(path: Path) -> TraceFormat:
    """Header test first (it is specific), then extension; ambiguity is an error."""
    _load_entry_points()
    line = _first_line(path)
    by_header = [f for f in _FORMATS.values() if f.sniff is not None and f.sniff(line)]
    if len(by_header) == 1:
        return by_header[0]
    suffix = path.suffix.lower()
    by_ext = [f for f in _FORMATS.values() if suffix in f.extensions]
    if not by_header and len(by_ext) == 1:
        return by_ext[0]
    found = by_header or by_ext
    why = ("matches formats " + ", ".join(f.name for f in found)) if found else \
        "matches no known format"
    raise InputError(f"cannot tell the trace format: the file {why}; pass format= one of "
                     f"{', '.join(trace_formats())}", file=str(path), line=1)


def load_trace(path: str | Path, format: str | None = None, **kw: Any) -> Trace:
    """Load a request trace, by the named format or by sniffing the header and extension.

    Extra keywords go to the format's loader. A missing file or malformed content raises
    ``InputError`` naming the file (and line and field where known).
    """
    p = Path(path)
    if not p.is_file():
        raise InputError("no such trace file" if not p.exists() else "not a regular file",
                         file=str(p))
    fmt = get_trace_format(format) if format is not None else _sniff(p)
    return fmt.loader(p, **kw)
