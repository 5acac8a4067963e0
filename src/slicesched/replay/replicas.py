"""A serving replica as the replay driver keeps it: its engine, device group, charged KV and prefill pace."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from slicesched.replay.deployment import Replica
from slicesched.replay.pipeline import Pipeline
from slicesched.sched.policies import isolated_prefill_s
from slicesched.serving import SLA, Batch, TenantEngine

BLOCK_TOKENS = 16  # tokens per KV block of every replica's pool
PREFILL_DECAY = 0.8  # weight of a replica's older prefill batches in its observed slowdown


@dataclass(slots=True, eq=False)
class ReplicaState:
    """A serving replica: its engine, device group and the KV bytes already charged to memory."""

    replica: Replica
    group: int
    engine: TenantEngine
    kv_bytes_per_token: float  # per device
    kv_charged: float = 0.0
    draining: bool = False
    move_to: str | None = None
    guest: bool = False  # serves overflow on other tenants' devices (SliceScheduler)
    prefill_only: bool = False  # a guest serving prompts only: its requests decode at home
    lent: list[tuple["ReplicaState", int]] = field(default_factory=list)  # (owner, KV blocks borrowed)
    pipe: Pipeline | None = None  # the stages of a pipeline-parallel replica (pp > 1)
    stage_kv: tuple[float, ...] = ()  # pp > 1: KV bytes per token per device of each stage
    stage_charged: list[float] = field(default_factory=list)  # pp > 1: KV bytes charged to each stage
    oom_at: float = -math.inf  # when an OOM last preempted it: no new batch until memory can change
    # decayed sums over its recent prefill batches: seconds taken, isolated prefill seconds computed
    prefill_taken: float = 0.0
    prefill_isolated: float = 0.0

    # The replica's own state changes only through these (the fleet and the driver call them).
    def book_kv(self, nbytes: float) -> None:
        """KV bytes per device now charged to its devices' memory."""
        self.kv_charged = nbytes

    def book_stage(self, stage: int, nbytes: float) -> None:
        """KV bytes per device now charged to one pipeline stage's devices."""
        self.stage_charged[stage] = nbytes

    def drain(self, move_to: str | None = None) -> None:
        """Take no new requests; with `move_to`, its devices serve that tenant once it is empty."""
        self.draining = True
        if move_to is not None:
            self.move_to = move_to

    def preempted_by_oom(self, t: float) -> None:
        """An OOM at `t` preempted its requests: no new batch until memory can change."""
        self.oom_at = t

    def observe_prefill(self, batch: Batch, taken_s: float, sla: SLA | None) -> None:
        """A batch carrying prefill took `taken_s` here (one batch at a time: its launch to its
        end): it joins the replica's prefill pace with the isolated seconds of the prompt tokens
        it computed (where the SLA's TTFT follows isolated latency)."""
        if sla is None or not sla.scale_ttft:
            return
        held = [(r.prompt_tokens, n) for rid, n, p in zip(batch.req_ids, batch.num_new_tokens, batch.is_prefill)
                if p and (r := self.engine.live_request(rid)) is not None]
        if held:
            prompts, tokens = np.array(held).T
            self.prefill_taken = PREFILL_DECAY * self.prefill_taken + taken_s
            self.prefill_isolated = PREFILL_DECAY * self.prefill_isolated + isolated_prefill_s(sla, prompts, tokens)

    @property
    def prefill_slowdown(self) -> float | None:
        """How much slower than isolated its recent prefill ran (decodes beside it, devices
        shared); None before any."""
        return self.prefill_taken / self.prefill_isolated if self.prefill_isolated > 0 else None

    @property
    def load(self) -> int:
        return self.engine.num_waiting + self.engine.num_running

    @property
    def relative_load(self) -> float:
        """Outstanding requests per KV token of capacity: balances replicas of unequal pools."""
        return (self.load + 1) / max(self.engine.kv.capacity_tokens, 1)


def least_loaded(replicas: Iterable[ReplicaState]) -> ReplicaState:
    """The replica with the fewest outstanding requests per KV token (`relative_load`)."""
    return min(replicas, key=lambda r: r.relative_load)
