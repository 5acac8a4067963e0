"""The trace-format registry: registration rules and format sniffing."""

from __future__ import annotations

from pathlib import Path

import pytest

from slicesched.errors import InputError
from slicesched.traces import Trace, load_trace, register_trace_format, registry, trace_formats


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test vanish after it."""
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))


def _dummy(path: Path, **kw: object) -> Trace:
    return Trace.from_columns("dummy", [0.0], [1], [1])


def test_builtin_formats_are_registered() -> None:
    assert {"azure", "burstgpt", "csv", "mooncake"} <= set(trace_formats())


def test_duplicate_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_trace_format("azure")(_dummy)


def test_new_format_is_used_by_name(tmp_path: Path) -> None:
    register_trace_format("dummy")(_dummy)
    f = tmp_path / "x.any"
    f.write_text("whatever\n")
    assert load_trace(f, format="dummy").name == "dummy"


def test_unknown_format_name_is_an_input_error(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("arrival_s,prompt_tokens,output_tokens\n")
    with pytest.raises(InputError) as e:
        load_trace(f, format="nope")
    assert e.value.field == "format"


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as e:
        load_trace(tmp_path / "absent.csv")
    assert e.value.file is not None and e.value.file.endswith("absent.csv")


@pytest.mark.parametrize(("header", "fmt"), [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,5,6\n", "azure"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "5,ChatGPT,3,4,7,Conversation log\n", "burstgpt"),
    ("arrival_s,prompt_tokens,output_tokens\n0.5,3,4\n", "csv"),
])
def test_csv_flavours_are_told_apart_by_header(tmp_path: Path, header: str, fmt: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    spec = registry._FORMATS[fmt]
    monkeypatch.setitem(registry._FORMATS, fmt, registry.TraceFormat(
        fmt, lambda p, **kw: (seen.append(fmt), spec.loader(p, **kw))[1],
        spec.extensions, spec.sniff))
    f = tmp_path / "trace.csv"
    f.write_text(header)
    load_trace(f)
    assert seen == [fmt]


def test_jsonl_extension_selects_mooncake(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n')
    assert load_trace(f).prefix_hashes.tolist() == [(1,)]


def test_unrecognisable_file_is_an_input_error(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("hello\n")
    with pytest.raises(InputError, match="cannot tell the trace format"):
        load_trace(f)
