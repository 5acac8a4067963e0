"""Real serving's fixtures: the two-tenant scenario as served (`real_helpers.TWO`) and its
models as eager generation builds them (a module may serve another scenario under the same
names: its own fixtures win)."""

from __future__ import annotations

import pytest

from scenario_helpers import scenario


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from real_helpers import TWO  # torch: imported by the tests that serve for real only
    from slicesched.replay.real import real_setup

    return real_setup(scenario(TWO), tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def eager(setup):
    from real_helpers import eager_models

    return eager_models(setup)
