"""The executor's what-if service: the simulator started from what the executor has really done
(reported slices done, the rest placed where they are mapped, KV as charged), rebuilt only when
that state changes."""

from __future__ import annotations

import numpy as np

from step_helpers import add_step, served_backend
from slicesched.cost import make_cost_model
from slicesched.decisions import SchedulerDecision
from slicesched.executor import ExecutorBackend
from slicesched.gmg.graph import SliceState


def _backend():
    be, spec, ex = served_backend(devices=2)
    be.gmg.load_home_weights()  # as the replay driver places its replicas' weights
    return ExecutorBackend(ex, be.gmg, be.served.factories, cost=make_cost_model("roofline")), spec, ex


def test_the_what_if_starts_from_the_steps_progress_and_the_kv_charged():
    be, spec, ex = _backend()
    try:
        assert be.alloc_kv(0, 4096.0, "a") is None
        first, dec = add_step(be, spec, tuple(range(30)))
        out = be.execute(dec, wake="slice")  # some of its slices reported, not all
        while not out.completed:
            out = be.execute(SchedulerDecision(be.now), wake="slice")
        base = be.what_if.base()
        ids = np.arange(first.slice_base, first.slice_base + first.num_slices)
        done = be.gmg.get("state", ids) == int(SliceState.DONE)
        assert set(base.gmg.iterations) == set(be.gmg.iterations) and 0 < done.sum()
        assert (base.gmg.get("state", ids)[done] == int(SliceState.DONE)).all()
        assert base.gmg.mem_kv[0] == 4096.0 and base.now >= out.time
        pred = be.what_if.fork().simulate(1.0, stop_after=[first.key])
        assert out.time < pred.iteration_end[first.key] < np.inf  # the rest run, priced by the cost model
    finally:
        ex.close()


def test_the_base_is_rebuilt_only_when_the_executors_state_changed():
    be, spec, ex = _backend()
    try:
        add_step(be, spec, (1, 2, 3))
        a = be.what_if.base()
        assert be.what_if.base() is a and be.what_if.rebuilds == 1
        be.alloc_kv(0, 1024.0, "a")
        assert be.what_if.base() is not a and be.what_if.rebuilds == 2
    finally:
        ex.close()
