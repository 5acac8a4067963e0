"""Every numeric field of the scenario schema has a range and a description, and a value out of
that range, written into a scenario file, is refused by `slicesched validate` with exit 2 and one
line naming the field: walked over the schema itself, so a field added later is covered too."""

from __future__ import annotations

import math
import typing

import annotated_types as at
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner

from slicesched.cli import app
from slicesched.config.settings import AegaeonConfig, PlanConfig, ReallocConfig, SliceSchedConfig
from slicesched.config.scenario import (DiurnalCurve, FlashCurve, ReplayConfig, Scenario,
                                        ServeGenStream, SyntheticStream, TenantConfig,
                                        TraceStream, ClusterConfig, NodeGroup)

runner = CliRunner()


def _models(model: type[BaseModel], seen: set) -> None:
    if model in seen:
        return
    seen.add(model)
    for f in model.model_fields.values():
        stack = [f.annotation]
        while stack:
            a = stack.pop()
            if isinstance(a, type) and issubclass(a, BaseModel):
                _models(a, seen)
            stack.extend(typing.get_args(a))


def numeric_fields() -> list[tuple[type[BaseModel], str, type, float | None, float | None]]:
    """(model, field, int or float, lower bound, upper bound) of every numeric field in the schema."""
    models: set = set()
    _models(Scenario, models)
    out = []
    for m in sorted(models, key=lambda m: m.__name__):
        for name, f in m.model_fields.items():
            if typing.get_origin(f.annotation) is tuple:
                continue  # a list of numbers: its model checks each (e.g. a curve's points)
            kinds = {a for a in (typing.get_args(f.annotation) or (f.annotation,)) if a in (int, float)}
            if not kinds or f.annotation is bool:
                continue
            lo = next((x.ge if isinstance(x, at.Ge) else x.gt for x in f.metadata if isinstance(x, (at.Ge, at.Gt))), None)
            hi = next((x.le if isinstance(x, at.Le) else x.lt for x in f.metadata if isinstance(x, (at.Le, at.Lt))), None)
            out.append((m, name, float if float in kinds else int, lo, hi))
    return out


FIELDS = numeric_fields()


def test_the_walk_sees_the_schema():
    names = {f"{m.__name__}.{n}" for m, n, *_ in FIELDS}
    assert {"Scenario.seed", "TenantConfig.tp", "ReplayConfig.duration_s", "FlashCurve.height",
            "ReallocConfig.interval_s", "SliceSchedConfig.horizon_s"} <= names


@pytest.mark.parametrize("model, name, kind, lo, hi", FIELDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_numeric_field_has_a_range_and_a_description(model, name, kind, lo, hi):
    assert lo is not None and hi is not None, f"{model.__name__}.{name} needs both bounds"
    assert model.model_fields[name].description, f"{model.__name__}.{name} needs a description"


BASE = """\
name = "s"
{top}
[cluster]
devices_per_node = 2
{cluster}
[[tenants]]
name = "a"
model = "qwen2.5-1.5b"
{tenant}
[[streams]]
{stream}
{curve}
[replay]
duration_s = 2
{replay}
{schedulers}
"""
SYNTHETIC = 'source = "synthetic"\ntenants = ["a"]\nrate = 4.0'
STREAMS = {SyntheticStream: SYNTHETIC, TraceStream: 'source = "trace"\npath = "none.csv"\ntenants = ["a"]',
           ServeGenStream: 'source = "servegen"\ntenants = ["a"]'}
CURVES = {DiurnalCurve: 'kind = "diurnal"', FlashCurve: 'kind = "flash"\nat_s = 1\nheight = 2'}


def scenario_with(model: type[BaseModel], line: str) -> str:
    """The base scenario with `line` (`field = value`) in the table `model` is read from."""
    parts = dict(top="", cluster="", tenant="", stream=SYNTHETIC, curve="", replay="", schedulers="")
    if model is Scenario:
        parts["top"] = line
    elif model is ClusterConfig:
        parts["cluster"] = line
    elif model is NodeGroup:
        parts["cluster"] = "__GROUP__\n" + line
    elif model is TenantConfig:
        parts["tenant"] = line
    elif model in STREAMS:
        parts["stream"] = STREAMS[model] + "\n" + line
    elif model in CURVES:
        parts["curve"] = "[[streams.curve]]\n" + CURVES[model].replace(line.split(" = ")[0] + " = ", "# ") + "\n" + line
    elif model is ReplayConfig:
        parts["replay"] = line
    elif model is ReallocConfig:
        parts["schedulers"] = "[schedulers.realloc]\n" + line
    elif model is SliceSchedConfig:
        parts["schedulers"] = "[schedulers.slicesched]\n" + line
    elif model is AegaeonConfig:
        parts["schedulers"] = "[schedulers.aegaeon]\n" + line
    elif model is PlanConfig:
        parts["schedulers"] = "[plan]\n" + line
    else:
        raise AssertionError(f"no place in the base scenario for {model.__name__}")
    text = BASE.format(**parts)
    if "__GROUP__" in text:  # a mixed fleet: the group's table instead of the single-kind fields
        text = text.replace("devices_per_node = 2\n__GROUP__", '[[cluster.node_groups]]\nname = "g"\n'
                            'device = "H100-80GB"\ndevices_per_node = 2')
    key = "\n" + line.split(" = ")[0] + " = "
    if text.count(key) > 1:  # the base sets it already: drop the base's line
        i = text.index(key)
        text = text[:i] + text[text.index("\n", i + 1):]
    return text


def toml_number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return "nan" if math.isnan(v) else "inf" if v == math.inf else "-inf" if v == -math.inf else repr(v)


@st.composite
def out_of_range(draw, kind: type, lo: float, hi: float):
    below = [lo - 1, lo - 1e-3 * max(1.0, abs(lo))] if kind is float else [math.floor(lo) - 1 - draw(st.integers(0, 5))]
    above = [hi * 2 + 1, hi + 1e-3 * max(1.0, abs(hi))] if kind is float else [math.ceil(hi) + 1 + draw(st.integers(0, 5))]
    extreme = [math.nan, math.inf, -math.inf, 1e300] if kind is float else [2**63 - 1]
    return draw(st.sampled_from(below + above + extreme))


@pytest.mark.parametrize("model, name, kind, lo, hi", FIELDS, ids=lambda v: getattr(v, "__name__", str(v)))
@settings(max_examples=3, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_an_out_of_range_value_is_one_line_naming_the_field(tmp_path_factory, model, name, kind, lo, hi, data):
    value = data.draw(out_of_range(kind, lo, hi))
    if kind is float and isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = float(value)
    path = tmp_path_factory.mktemp("s") / "s.toml"
    path.write_text(scenario_with(model, f"{name} = {toml_number(value)}"))
    r = runner.invoke(app, ["validate", str(path)])
    assert r.exit_code == 2, (name, value, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], (name, value, r.stderr)
