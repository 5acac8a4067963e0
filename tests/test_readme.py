"""The README's extension examples run as written: the scheduler serves a replay, the cost
model prices an iteration, the trace format loads a file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from slicesched.cost.model import make_cost_model
from slicesched.gmg import BatchShape, build_iteration
from slicesched.hardware import DEVICES, LINKS
from slicesched.models.spec import model_spec
from slicesched.replay.driver import ReplayDriver
from slicesched.sched import make_scheduler
from slicesched.serving import RequestState
from slicesched.traces import Trace, load_trace
from scenario_helpers import scenario

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def examples() -> dict:
    """Every python block of the README, run once in one namespace (they register plug-ins)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 3
    ns: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - the README's own examples
    return ns


def test_the_example_scheduler_serves_a_replay(examples: dict, tiny_scenario_toml: str) -> None:
    sc = scenario(tiny_scenario_toml)
    trace = Trace.from_columns("t", [0.0, 0.2, 0.4], [128] * 3, [4] * 3, ["a", "b", "a"])
    res = ReplayDriver(sc, make_scheduler("home-first", sc), trace, cost=make_cost_model()).run()
    assert [r.state for r in res.requests] == [RequestState.FINISHED] * 3


def test_the_example_cost_model_prices_an_iteration(examples: dict) -> None:
    graph = build_iteration(model_spec("llama-3-8b"), BatchShape.decode(8, 512), 1)
    times = make_cost_model("flat").op_times(graph, DEVICES["H100-80GB"], LINKS["nvlink4"])
    assert times.shape == (graph.num_ops,) and np.all(times >= 0) and times.sum() > 0


def test_the_example_trace_format_loads_its_files(examples: dict, tmp_path: Path) -> None:
    path = tmp_path / "a.mylog"
    path.write_text("t\tprompt\tcompletion\tmodel\n10.0\t5\t7\tx\n9.5\t3\t2\ty\n", encoding="utf-8")
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 0.5] and trace.prompt_tokens.tolist() == [3, 5]
