"""`benchmarks/ceiling.py`: the scenario it searches has one tenant alone on every device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slicesched.config import load_scenario
from slicesched.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ceiling  # noqa: E402


def test_the_tenant_alone_fills_every_device_and_keeps_its_stream():
    sc = load_scenario(ceiling.SCENARIOS["default"])
    solo = ceiling.alone(sc, "docs-llama2-13b")  # tp = 2 on 8 devices
    (t,) = solo.tenants
    assert (t.name, t.tp, t.replicas) == ("docs-llama2-13b", 2, 4)
    assert [s.tenants for s in solo.streams] == [("docs-llama2-13b",)]
    assert solo.cluster == sc.cluster


def test_a_tenant_sharing_a_stream_is_refused():
    sc = load_scenario(ROOT / "scenarios/azure_code_conv.toml")
    with pytest.raises(InputError, match="shares a stream"):
        ceiling.alone(sc, "conv-llama3-8b")


def test_the_default_tenant_is_the_one_with_most_requests():
    shares = ceiling.request_shares(load_scenario(ceiling.SCENARIOS["hot_cold"]))
    assert shares.most_common(1)[0][0] == "hot"
    assert sum(shares.values()) == pytest.approx(1.0)
