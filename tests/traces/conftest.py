"""Fixtures locating the shared real traces; tests that need them skip when they are absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _shared_dir() -> Path:
    env = os.environ.get("SLICESCHED_SHARED")
    return Path(env) if env else REPO_ROOT / ".." / "shared"


def _require(rel: str) -> Path:
    path = _shared_dir() / "traces" / rel
    if not path.exists():
        pytest.skip(f"shared trace data absent: {path}")
    return path


@pytest.fixture(scope="session")
def azure_dir() -> Path:
    return _require("azure_llm_2023")


@pytest.fixture(scope="session")
def mooncake_dir() -> Path:
    return _require("mooncake_fast25")


@pytest.fixture(scope="session")
def servegen_root() -> Path:
    return _require("servegen/data")
