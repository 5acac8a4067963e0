"""Global simulator over the GMG: replay backend, what-if forks, incremental re-simulation.

    sim = Simulator(gmg, cost_model, perturbation=Perturbation(seed))   # the replay backend
    outcome = sim.execute(decision, until=next_arrival)                 # Backend protocol
    sim.alloc_kv(devices, nbytes, tenant) / sim.free_kv(...)            # the driver's KV cache
    fork = sim.fork(); fork.apply(candidate); p = fork.simulate(0.1)    # a what-if -> Prediction
    inc = Incremental(sim, decision, 0.1); inc.predict(moved_run)       # many variants of one

Execution model:
- a slice mapped to a group becomes runnable when its predecessors are done, inputs from other
  groups have arrived and its weight blocks are resident on every device of the group; it then
  waits in one queue ordered by (runnable time, slice id), and whenever devices free up the queue
  is scanned in order and every slice whose devices all have a free stream starts (greedy, no
  reservation);
- a running slice occupies one stream on every device of its group for the sum of its ops'
  durations (ops run back to back; their times are derived from a cumulative sum on demand),
  slowed by `1 + stream_slowdown * k` where k counts other slices on those devices at its start,
  or, with spatial sharing (`contention.py`), at rates that follow who runs beside it;
- a slice's output moves to each consumer on another group as soon as both the slice is done and
  the consumer is mapped; weight copies move blocks from a peer device or host memory;
- memory follows `memory.py`; an activation that does not fit is an OOM: the slice (or the
  transfer into it) does not start, the slice is unmapped so the scheduler can place it again,
  and the driver sees the OOMEvent (it may preempt and recompute with `abort_iteration`).

The simulator (`engine.py`) owns the clock, the event heap, the running slices, the free
streams and the ready queue; its collaborators own the rest: `Placement` (activations between
slices, iteration spans), `Residency` (slices waiting for weights), `Segments` (chains run as one
event), `Timings` (slice timings in use), `Forks` (fork plans and focus), `Outcomes` (what the
run reports) and `Lifecycle` (iterations ending, the driver's KV).
"""

from slicesched.sim.contention import SharingModel, owners_of
from slicesched.sim.engine import Simulator
from slicesched.sim.events import Prio, SimulationError
from slicesched.sim.incremental import Incremental
from slicesched.sim.perturbation import Perturbation
from slicesched.sim.prediction import Prediction

__all__ = ["Simulator", "SharingModel", "owners_of", "Prio", "SimulationError", "Incremental", "Perturbation", "Prediction"]
