"""Loaders: real public traces reproduce SOURCES.md; malformed input is located exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slicesched.errors import InputError
from slicesched.traces import Trace, load_trace

# (file, requests, duration s, prompt mean, output mean) from shared/traces/SOURCES.md
AZURE = [("AzureLLMInferenceTrace_code.csv", 8819, 3435.9, 2047.8, 27.9),
         ("AzureLLMInferenceTrace_conv.csv", 19366, 3501.7, 1154.7, 211.1)]
MOONCAKE = [("conversation_trace.jsonl", 12031, 3537.0, 12035.1, 342.6),
            ("synthetic_trace.jsonl", 3993, 1022.0, 15325.5, 149.1)]


def _check_against_sources(t: Trace, n: int, duration: float, prompt: float,
                           output: float) -> None:
    s = t.summary()
    assert s["count"] == n
    assert s["duration_s"] == pytest.approx(duration, abs=0.05)
    assert s["prompt_mean"] == pytest.approx(prompt, abs=0.05)
    assert s["output_mean"] == pytest.approx(output, abs=0.05)


@pytest.mark.parametrize(("name", "n", "duration", "prompt", "output"), AZURE)
def test_azure_matches_sources(azure_dir: Path, name: str, n: int, duration: float,
                               prompt: float, output: float) -> None:
    _check_against_sources(load_trace(azure_dir / name), n, duration, prompt, output)


@pytest.mark.parametrize(("name", "n", "duration", "prompt", "output"), MOONCAKE)
def test_mooncake_matches_sources(mooncake_dir: Path, name: str, n: int, duration: float,
                                  prompt: float, output: float) -> None:
    _check_against_sources(load_trace(mooncake_dir / name), n, duration, prompt, output)


def test_azure_arrivals_start_at_zero(azure_dir: Path) -> None:
    assert load_trace(azure_dir / AZURE[0][0]).arrival_s[0] == 0.0


def test_mooncake_prefix_reuse_matches_sources(mooncake_dir: Path) -> None:
    t = load_trace(mooncake_dir / "conversation_trace.jsonl")
    blocks = [h for hs in t.prefix_hashes.tolist() for h in hs]
    assert (len(blocks), len(set(blocks))) == (288500, 182790)


def _corrupt_line(src: Path, dst: Path, line: int, old: str, new: str) -> Path:
    lines = src.read_text().splitlines(keepends=True)
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    dst.write_text("".join(lines))
    return dst


def test_azure_bad_token_field_reports_line_and_field(azure_dir: Path, tmp_path: Path) -> None:
    src = azure_dir / AZURE[0][0]
    line = 101  # 1-based, header is line 1
    bad_value = src.read_text().splitlines()[line - 1].rsplit(",", 1)[1]
    f = _corrupt_line(src, tmp_path / "code.csv", line, "," + bad_value + "\n", ",abc\n")
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert (e.value.line, e.value.field) == (line, "GeneratedTokens")
    assert "expected a token count from 1 to 1,048,576, got 'abc'" in str(e.value)


def _load_error(path: Path, text: str) -> InputError:
    """The InputError loading a trace file holding `text` raises."""
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_trace(path)
    return e.value


def test_azure_bad_timestamp_reports_line_and_field(tmp_path: Path) -> None:
    e = _load_error(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,5,6\n2023-11-16 18:61:99,5,6\n")
    assert (e.line, e.field) == (3, "TIMESTAMP")


def test_mooncake_bad_field_reports_line_and_field(mooncake_dir: Path, tmp_path: Path) -> None:
    src = mooncake_dir / "synthetic_trace.jsonl"
    f = _corrupt_line(src, tmp_path / "m.jsonl", 50, '"input_length": ', '"input_length": -')
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert (e.value.line, e.value.field) == (50, "input_length")


def test_mooncake_invalid_json_reports_line(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n\n{"timestamp": 1,\n')
    with pytest.raises(InputError) as e:
        load_trace(f, format="mooncake")
    assert e.value.line == 3


def test_mooncake_missing_key_reports_field(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"timestamp": 0, "input_length": 1}) + "\n")
    with pytest.raises(InputError) as e:
        load_trace(f, format="mooncake")
    assert (e.value.line, e.value.field) == (1, "output_length")


def test_mooncake_bad_hash_ids_reports_field(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2]},
            {"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1, "x"]}]
    f = tmp_path / "m.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert (e.value.line, e.value.field) == (2, "hash_ids")


BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n"
            "7,GPT-4,1087,0,1087,Conversation log\n"
            "12,GPT-4,200,35,235,API log\n")


def test_burstgpt_drops_failed_requests_and_rebases(tmp_path: Path) -> None:
    f = tmp_path / "BurstGPT_sample.csv"
    f.write_text(BURSTGPT)
    t = load_trace(f)
    assert t.arrival_s.tolist() == [0.0, 7.0]
    assert t.output_tokens.tolist() == [18, 35]


def test_burstgpt_model_becomes_tenant(tmp_path: Path) -> None:
    f = tmp_path / "b.csv"
    f.write_text(BURSTGPT)
    assert load_trace(f).tenant.tolist() == ["ChatGPT", "GPT-4"]


def test_burstgpt_bad_field_reports_line(tmp_path: Path) -> None:
    f = tmp_path / "b.csv"
    f.write_text(BURSTGPT.replace("200,35", "200,3.5"))
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert (e.value.line, e.value.field) == (4, "Response tokens")


def test_plain_csv_round_trips_with_tenants(tmp_path: Path) -> None:
    t = Trace.from_columns("x", [0.25, 1.5], [10, 20], [3, 4], ["a", "b"])
    t.to_csv(tmp_path / "x.csv")
    back = load_trace(tmp_path / "x.csv")
    assert np.array_equal(back.arrival_s, t.arrival_s)
    assert back.tenant.tolist() == ["a", "b"]


def test_plain_csv_empty_tenant_means_none(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("arrival_s,prompt_tokens,output_tokens,tenant\n0,1,1,\n1,1,1,a\n")
    assert load_trace(f).tenant.tolist() == [None, "a"]


def test_plain_csv_negative_arrival_reports_line(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("arrival_s,prompt_tokens,output_tokens\n0,1,1\n-2,1,1\n")
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert (e.value.line, e.value.field) == (3, "arrival_s")


def test_blank_line_inside_csv_reports_its_line(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("arrival_s,prompt_tokens,output_tokens\n0,1,1\n\n2,1,1\n\n")
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert e.value.line == 3


def test_extra_field_reports_line(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("arrival_s,prompt_tokens,output_tokens\n0,1,1\n1,1,1\n2,1,1,9\n")
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert e.value.line == 4


def test_missing_header_column_reports_field(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("arrival_s,prompt_tokens\n0,1\n")
    with pytest.raises(InputError) as e:
        load_trace(f)
    assert (e.value.line, e.value.field) == (1, "output_tokens")


@pytest.mark.parametrize("value", ["0", "2000000"])
def test_plain_csv_token_count_out_of_range_reports_line(tmp_path: Path, value: str) -> None:
    e = _load_error(tmp_path / "t.csv", f"arrival_s,prompt_tokens,output_tokens\n0.1,100,10\n0.2,100,{value}\n")
    assert (e.line, e.field) == (3, "output_tokens") and "from 1 to 1,048,576" in e.message


def test_mooncake_zero_input_length_reports_line(tmp_path: Path) -> None:
    e = _load_error(tmp_path / "t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 5}\n\n'
                    '{"timestamp": 5, "input_length": 0, "output_length": 5}\n')
    assert (e.line, e.field) == (3, "input_length")
