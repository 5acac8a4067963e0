"""The replicas a replay serves with, and what waits for one: the one owner of which replicas
exist (home, guests, new ones after a container move), of arrivals parked while their tenant
has none, and of replicas whose weights are still loading."""

from __future__ import annotations

import math
from collections.abc import Iterator

from slicesched.replay.deployment import Replica
from slicesched.replay.replicas import ReplicaState
from slicesched.serving import Request


class Fleet:
    """Replicas in serving order (the order arrivals and launches visit them), parked arrivals
    per tenant, and replicas loading (ready time, replica)."""

    def __init__(self, replicas: list[ReplicaState]) -> None:
        self.replicas = list(replicas)
        self.parked: dict[str, list[Request]] = {}
        self.loading: list[tuple[float, Replica]] = []

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self.replicas)

    def enlist(self, rs: ReplicaState) -> None:
        """A replica starts serving (after the ones already serving)."""
        self.replicas.append(rs)

    def retire(self, rs: ReplicaState) -> None:
        """A replica stops serving (drained, or a guest released)."""
        self.replicas.remove(rs)

    def of(self, tenant: str) -> list[ReplicaState]:
        return [rs for rs in self.replicas if rs.replica.tenant == tenant]

    def owner_of(self, device: int) -> ReplicaState | None:
        """The (non-guest) replica whose container holds `device`."""
        return next((rs for rs in self.replicas if not rs.guest and device in rs.replica.devices), None)

    @property
    def guests_live(self) -> bool:
        """Is any guest replica up (the only replicas that share devices with another tenant's)?"""
        return any(rs.guest for rs in self.replicas)

    # ---- arrivals without a replica ------------------------------------------------------------
    def park(self, req: Request) -> None:
        self.parked.setdefault(req.tenant, []).append(req)

    def unpark(self, tenant: str) -> list[Request]:
        return self.parked.pop(tenant, [])

    def parked_counts(self) -> dict[str, int]:
        return {t: len(q) for t, q in self.parked.items()}

    # ---- replicas loading their weights ----------------------------------------------------------
    def load(self, ready_s: float, replica: Replica) -> None:
        self.loading.append((ready_s, replica))

    def next_loaded(self) -> float:
        return min((t for t, _ in self.loading), default=math.inf)

    def take_loaded(self, now: float) -> list[Replica]:
        """Replicas whose weights are resident by `now`, in the order they started loading."""
        ready = [r for t, r in self.loading if t <= now]
        if ready:
            self.loading = [(t, r) for t, r in self.loading if t > now]
        return ready
