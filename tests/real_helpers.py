"""Checking real serving against eager greedy generation of the same random-weight models."""

from __future__ import annotations

from slicesched.executor.serving import build_model, greedy_reference

#: Two tenants of different shapes on two CPU devices, a second of arrivals.
TWO = """
    name = "two"
    seed = 5
    [cluster]
    devices_per_node = 2
    [[tenants]]
    name = "a"
    model = "llama-3-8b"
    max_batch_tokens = 64
    [[tenants]]
    name = "b"
    model = "qwen2.5-1.5b"
    max_batch_tokens = 64
    [[streams]]
    source = "synthetic"
    tenants = ["a"]
    rate = 8.0
    prompt_mean = 40
    output_mean = 8
    [[streams]]
    source = "synthetic"
    tenants = ["b"]
    rate = 4.0
    prompt_mean = 100
    output_mean = 6
    [replay]
    duration_s = 1.0
    drain_s = 20
"""


def eager_models(setup, device: str = "cpu") -> dict:
    """Per tenant, its served model built as serving builds it (same config, same seed)."""
    return {t: build_model(setup.configs[t], setup.seeds[t], device) for t in setup.configs}


def mismatches(requests, eager: dict) -> list[int]:
    """Ids of the requests whose tokens differ from eager greedy generation of their model."""
    return [r.id for r in requests
            if tuple(r.output_ids or ()) != greedy_reference(eager[r.tenant], r.prompt_ids, r.num_generated)]
