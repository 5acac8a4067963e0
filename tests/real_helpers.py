"""Checking real serving against eager greedy generation of the same random-weight models."""

from __future__ import annotations

from slicesched.executor.serving import build_model, greedy_reference


def eager_models(setup, device: str = "cpu") -> dict:
    """Per tenant, its served model built as serving builds it (same config, same seed)."""
    return {t: build_model(setup.configs[t], setup.seeds[t], device) for t in setup.configs}


def mismatches(requests, eager: dict) -> list[int]:
    """Ids of the requests whose tokens differ from eager greedy generation of their model."""
    return [r.id for r in requests
            if tuple(r.output_ids or ()) != greedy_reference(eager[r.tenant], r.prompt_ids, r.num_generated)]
