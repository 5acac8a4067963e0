"""Fixtures shared by the executor tests."""

from __future__ import annotations

import pytest

from executor_models import make_steps


@pytest.fixture(scope="session")
def steps():
    """family -> (CausalLMStep, prefill args, decode args, exported prefill, exported decode)."""
    return make_steps()
