"""Cost models: predicted op, transfer and collective times."""

from slicesched.cost.model import COST_MODELS, CostModel, make_cost_model
from slicesched.cost.roofline import RooflineCostModel
from slicesched.cost.calibrated import CalibratedCostModel  # registers "calibrated"
from slicesched.cost.profile import Profile, load_profile

__all__ = ["COST_MODELS", "CostModel", "make_cost_model", "RooflineCostModel", "CalibratedCostModel", "Profile",
           "load_profile"]
