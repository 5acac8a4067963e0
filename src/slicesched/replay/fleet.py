"""The replicas a replay serves with, and what waits for one: the one owner of which replicas
exist (home, guests, new ones after a container move) and of arrivals parked while their
tenant has none."""

from __future__ import annotations

from collections.abc import Iterator

from slicesched.replay.replicas import ReplicaState
from slicesched.serving import Request


class Fleet:
    """Replicas in serving order (the order arrivals and launches visit them) and parked
    arrivals per tenant."""

    def __init__(self, replicas: list[ReplicaState]) -> None:
        self.replicas = list(replicas)
        self.parked: dict[str, list[Request]] = {}

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

    def on_group(self, group: int) -> list[ReplicaState]:
        """The replicas whose iterations run on a device group (several where models share it)."""
        return [rs for rs in self.replicas if rs.group == group]

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

    def withdraw(self, req: Request) -> bool:
        """A parked request leaves (its client went away); False if it was not parked."""
        waiting = self.parked.get(req.tenant, [])
        if req not in waiting:
            return False
        waiting.remove(req)
        return True

    def parked_counts(self) -> dict[str, int]:
        return {t: len(q) for t, q in self.parked.items()}
