"""Typed, validated configuration: scenario files."""

from slicesched.config.scenario import (AegaeonConfig, ClusterConfig, ReallocConfig, ReplayConfig, Scenario, SchedulersConfig,
                                        SliceSchedConfig, TenantConfig, load_scenario, parse_scenario, shared_dir)

__all__ = ["AegaeonConfig", "ClusterConfig", "ReallocConfig", "ReplayConfig", "Scenario", "SchedulersConfig", "SliceSchedConfig",
           "TenantConfig", "load_scenario", "parse_scenario",
           "shared_dir"]
