"""Which experts an MoE iteration's tokens pick: the routing model MoE graphs are priced by.

Expert popularity: expert j (0 the most popular) is picked with weight 1 / (j + 1)^skew: skew 0
is uniform routing, skew 1 a Zipf law (routers trained with a balancing loss stay near uniform;
skew stands for traffic whose tokens favour some experts). Each token picks `k` distinct
experts; expert j is among a token's picks with probability q_j = min(1, c p_j), c chosen so
that the q_j sum to k (a token's k picks). Over T tokens expert j then computes T q_j
token-rows (the q_j sum to k: the expert GEMMs of an iteration sum to k T rows) and is touched
(its weights read) with probability 1 - (1 - q_j)^T.

Expert parallelism places experts on the tp ranks in contiguous blocks (rank r holds experts
r E/tp .. (r+1) E/tp - 1, vLLM's default placement), so under skew the first rank holds the
most popular; a step waits for its busiest rank, which is the one a graph prices.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=64)
def pick_probs(num_experts: int, k: int, skew: float) -> np.ndarray:
    """q_j: the probability that expert j is among one token's k picks (sums to k)."""
    w = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** skew
    p = w / w.sum()
    q = np.zeros_like(p)
    capped = np.zeros(num_experts, bool)
    for _ in range(num_experts):  # water-filling: experts that would exceed 1 are capped at 1
        left = k - capped.sum()
        q[~capped] = p[~capped] * left / p[~capped].sum()
        over = q > 1.0
        if not over.any():
            break
        capped |= over
        q[capped] = 1.0
    q.flags.writeable = False
    return q


@lru_cache(maxsize=64)
def _busiest(num_experts: int, k: int, skew: float, ranks: int) -> np.ndarray:
    """The pick probabilities of the experts on the busiest of `ranks` expert-parallel ranks."""
    q = pick_probs(num_experts, k, skew).reshape(ranks, -1)
    out = q[int(np.argmax(q.sum(1)))].copy()
    out.flags.writeable = False
    return out


def expert_load(num_experts: int, k: int, skew: float, tokens: int, ranks: int = 1) -> tuple[float, float]:
    """(expert token-rows computed, experts touched) on one device: all experts (ranks=1, or
    each cut tensor-parallel), or the busiest rank's of `ranks` expert-parallel ranks."""
    if skew == 0:  # uniform: every expert q = k / E, every rank alike (exact, no summation)
        return tokens * k / ranks, num_experts / ranks * (1 - (1 - k / num_experts) ** tokens)
    q = pick_probs(num_experts, k, skew) if ranks == 1 else _busiest(num_experts, k, skew, ranks)
    return tokens * float(q.sum()), float(np.sum(1.0 - (1.0 - q) ** tokens))
