"""Global simulator over the GMG: replay backend, what-if forks, incremental re-simulation.

    sim = Simulator(gmg, cost_model, perturbation=Perturbation(seed))   # the replay backend
    outcome = sim.execute(decision, until=next_arrival)                 # Backend protocol
    sim.alloc_kv(devices, nbytes, tenant) / sim.free_kv(...)            # the driver's KV cache
    fork = sim.fork(); fork.apply(candidate); p = fork.simulate(0.1)    # a what-if -> Prediction
    inc = Incremental(sim, decision, 0.1); inc.predict(moved_run)       # many variants of one
"""

from slicesched.sim.engine import Simulator
from slicesched.sim.events import Prio, SimulationError
from slicesched.sim.incremental import Incremental
from slicesched.sim.perturbation import Perturbation
from slicesched.sim.prediction import Prediction

__all__ = ["Simulator", "Prio", "SimulationError", "Incremental", "Perturbation", "Prediction"]
