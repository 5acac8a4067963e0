"""Global simulator over the GMG: replay backend, what-if forks, incremental re-simulation."""

from slicesched.sim.engine import Simulator
from slicesched.sim.events import Prio, SimulationError
from slicesched.sim.perturbation import Perturbation
from slicesched.sim.prediction import Prediction

__all__ = ["Simulator", "Prio", "SimulationError", "Perturbation", "Prediction"]
