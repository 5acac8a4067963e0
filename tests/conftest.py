"""Shared fixtures: the location of the public traces in ../shared (skip when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shared() -> Path:
    env = os.environ.get("SLICESCHED_SHARED")
    return Path(env) if env else REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    p = _shared() / "traces"
    if not p.is_dir():
        pytest.skip(f"shared traces not found at {p}")
    return p


#: Two small tenants on two devices: a replay of it takes a second or two.
TINY_SCENARIO = """\
name = "tiny"
[cluster]
devices_per_node = 2
[[tenants]]
name = "a"
model = "qwen2.5-1.5b"
[[tenants]]
name = "b"
model = "qwen2.5-1.5b"
[[streams]]
source = "synthetic"
tenants = ["a", "b"]
rate = 4.0
prompt_mean = 256
output_mean = 16
[replay]
duration_s = 2
drain_s = 10
schedulers = ["dedicated", "temporal-mux"]
"""


@pytest.fixture(scope="session")
def tiny_scenario_toml() -> str:
    return TINY_SCENARIO
