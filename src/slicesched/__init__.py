"""SliceScheduler: operator-granularity, simulation-guided scheduling for multi-tenant LLM serving."""

__version__ = "0.1.0"
