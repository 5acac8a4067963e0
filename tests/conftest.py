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
