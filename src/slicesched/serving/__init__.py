"""Per-tenant serving: requests, paged KV blocks, continuous batching, SLAs and metrics.

A driver (simulator or executor) feeds arrivals to a ``TenantEngine``, runs the ``Batch`` it
returns, and reports completion; ``metrics.summarize`` turns the finished run into numbers.
"""

from slicesched.serving.engine import Batch, TenantEngine
from slicesched.serving.kv_cache import KVBlockManager, PagedKVBlockManager, blocks_for
from slicesched.serving.metrics import (
    DeviceHarvest,
    HarvestSummary,
    IdleHistogram,
    ServingSummary,
    TenantSummary,
    busy_fraction,
    count_violations,
    harvest_share,
    idle_interval_histogram,
    idle_intervals,
    request_frame,
    summarize,
)
from slicesched.serving.prefix import PagedPrefixCachingKV, PrefixCachingKV, key_prefixes, prefix_keys, token_keys
from slicesched.serving.request import Request, RequestState
from slicesched.serving.sla import DEFAULT_SLA_SCALE, SLA, IsolatedLatency

__all__ = [
    "Batch", "TenantEngine", "KVBlockManager", "PagedKVBlockManager", "PrefixCachingKV", "PagedPrefixCachingKV", "key_prefixes", "token_keys",
    "prefix_keys", "blocks_for", "DeviceHarvest", "HarvestSummary",
    "harvest_share", "IdleHistogram", "ServingSummary",
    "TenantSummary", "busy_fraction", "count_violations", "idle_interval_histogram",
    "idle_intervals", "request_frame", "summarize", "Request",
    "RequestState", "DEFAULT_SLA_SCALE", "SLA", "IsolatedLatency",
]
