"""The CPU validation report: executor vs simulator on a tiny trace."""

import numpy as np
import pytest

pytest.importorskip("transformers")

from slicesched.cost import CalibratedCostModel  # noqa: E402
from slicesched.executor.profiler import Step, Width, prepare_grid, profile_of  # noqa: E402
from slicesched.executor.fidelity import calibrate_and_validate, plot, prepare_trace, validate  # noqa: E402

TENANT = {"t": Width(96, 256, 4, 2, layers=2, vocab=256)}
TRACE = (Step(1, 32), Step(2, 1, 64))


class Scaled:
    """A cost model `factor` times another (a deliberately wrong prediction)."""

    prices_ops_alone = False

    def __init__(self, inner, factor):
        self.inner, self.factor = inner, factor

    def op_times(self, g, d, link):
        return self.factor * self.inner.op_times(g, d, link)

    def transfer_time(self, n, link):
        return self.inner.transfer_time(n, link)

    def allreduce_time(self, n, p, link):
        return self.inner.allreduce_time(n, p, link)


@pytest.fixture(scope="module")
def run():
    grid = prepare_grid((Width(64, 160, 4, 2, vocab=256), Width(128, 352, 4, 4, vocab=256)),
                        (Step(1, 16), Step(1, 64), Step(2, 1, 32)))
    items = prepare_trace(TENANT, TRACE)
    report, profile = calibrate_and_validate(grid, items, repeats=3)
    return grid, items, report, profile


def test_profile_of_local_runs_names_device_and_torch(run) -> None:
    _, _, _, profile = run
    assert set(profile.df["device"]) == {"cpu"} and profile.df["torch_version"].str.len().min() > 0
    assert {"qkv_proj", "attention", "norm", "mlp_up", "residual_add"} <= set(profile.df["kind"])
    assert set(profile.df.loc[profile.df["kind"] == "attention", "phase"]) == {"prefill", "decode"}
    assert (profile.df["time_s"] > 0).all()


def test_report_compares_every_iteration_and_the_peak(run, tmp_path) -> None:
    _, items, report, _ = run
    it = report.iterations
    assert len(it) == len(items) and (it["measured_s"] > 0).all() and (it["predicted_s"] > 0).all()
    np.testing.assert_allclose(it["error_pct"], (it["predicted_s"] - it["measured_s"]) / it["measured_s"] * 100)
    assert report.peak_memory_pct < 2  # real tensors vs the spec and the captured graph
    assert set(report.ops["kind"]) >= {"qkv_proj", "attention"}
    plot(report, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_simulator_with_the_fit_reproduces_the_measured_grid(run) -> None:
    """The same timings both sides: the fitted model, run through the simulator, gives back the
    grid's iterations; a model 3x off shows up as ~200% error."""
    grid, _, _, _ = run
    # Timings of a known device (a floor plus FLOPs and bytes terms): deterministic, unlike this
    # box's CPU clock under load, so the test checks the fit and the simulator, not the machine.
    times = [3e-6 + it.graph.flops / 4e9 + (it.graph.bytes_read + it.graph.bytes_written) / 2e9 for it in grid]
    profile = profile_of(grid, times)
    as_trace = [(f"w{it.width.hidden}", it) for it in grid]
    fitted = validate(CalibratedCostModel(profile), as_trace, times=times)
    assert fitted.iteration_median_pct < 5
    wrong = validate(Scaled(CalibratedCostModel(profile), 3.0), as_trace, times=times)
    assert wrong.iteration_median_pct > 150


def test_predicted_peak_memory_holds_the_past_and_the_returned_cache() -> None:
    """A decode over a long context: the executor's step holds the past cache and the
    concatenated one it returns; the simulator's peak matches the real tensors within 2%."""
    from slicesched.cost import make_cost_model
    from slicesched.executor.fidelity import measured_peak, simulate

    items = prepare_trace(TENANT, (Step(4, 1, 400),))
    measured = measured_peak(items)
    _, predicted = simulate(items, make_cost_model())
    assert abs(predicted - measured) / measured < 0.02
