"""Typed, validated configuration: scenario files (`scenario.py`), the settings of schedulers and
of the planner (`settings.py`), and what every part of the schema shares (`fields.py`)."""

from slicesched.config.scenario import (ClusterConfig, ReplayConfig, Scenario, TenantConfig, load_scenario,
                                        parse_scenario, shared_dir)
from slicesched.config.settings import (AegaeonConfig, PlanConfig, ReallocConfig, SchedulersConfig,
                                        SliceSchedConfig)

__all__ = ["AegaeonConfig", "ClusterConfig", "PlanConfig", "ReallocConfig", "ReplayConfig", "Scenario",
           "SchedulersConfig", "SliceSchedConfig", "TenantConfig", "load_scenario", "parse_scenario", "shared_dir"]
