"""Cost models: predicted op, transfer and collective times."""

from slicesched.cost.model import COST_MODELS, CostModel, make_cost_model
from slicesched.cost.roofline import RooflineCostModel

__all__ = ["COST_MODELS", "CostModel", "make_cost_model", "RooflineCostModel"]
