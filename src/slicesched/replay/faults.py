"""Device workers that die and come back (`StepOutcome.lost_devices` / `back_devices`): what the
replay driver does so that no request is lost.

A lost device leaves the fleet with every replica on it (home or guest): their iterations in
flight are dropped, their requests give up their KV (it died with the worker) and are recomputed
on the tenant's other replicas, or wait, parked, for one. The scheduler plans on the replicas
left, as after a container move. A home replica whose devices are all back starts again there
(its weights loaded as at a cold start) and takes the parked requests of its tenant.

A fault's requests resume when the first of them makes progress again (its KV recomputed, one
more output token than when the worker died), and it is recovered when every one has (or is done).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slicesched.replay.deployment import Replica
from slicesched.replay.replicas import ReplicaState, least_loaded
from slicesched.serving import Request, RequestState

if TYPE_CHECKING:
    from slicesched.replay.driver import ReplayDriver


@dataclass(slots=True)
class Fault:
    """One loss of device workers, as the report shows it."""

    time_s: float
    devices: tuple[int, ...]
    requests: list[tuple[Request, int]] = field(default_factory=list)  # hit: (request, tokens it had)
    resumed_s: float | None = None  # seconds from `time_s` until the first request it hit made progress again
    recovered_s: float | None = None  # ... until every request it hit made progress again (or finished)


class Faults:
    """Lost and returning devices for one replay (the fleet's replicas change through it)."""

    def __init__(self, driver: "ReplayDriver") -> None:
        self.drv = driver
        self.down: set[int] = set()
        self.waiting: list[Replica] = []  # home replicas lost, to start again once their devices are back
        self.log: list[Fault] = []

    def lost(self, devices: tuple[int, ...], now: float) -> list[ReplicaState]:
        """Devices whose workers died: their replicas leave the fleet, their requests go to the
        tenant's other replicas (or park). Returns the replicas that took requests."""
        drv = self.drv
        new = set(devices) - self.down
        if not new:
            return []
        self.down |= new
        fault = Fault(now, tuple(sorted(new)))
        self.log.append(fault)
        touched: dict[ReplicaState, None] = {}
        for rs in [r for r in drv.fleet if new & set(r.replica.devices)]:
            drv.drop_inflight(rs)
            reqs = rs.engine.evict_all(now)  # running ones preempted: recomputed where they go
            fault.requests += [(r, r.num_generated) for r in reqs]
            self._leave(rs, now)
            for req in reqs:
                rest = [r for r in drv.fleet.of(req.tenant) if not r.draining]
                if rest:
                    to = least_loaded(rest)
                    to.engine.adopt(req, now)
                    touched[to] = None
                else:
                    drv.fleet.park(req)
        return list(touched)

    def _leave(self, rs: ReplicaState, now: float) -> None:
        """A replica on a lost device stops: its KV charge and weights go, its borrowed blocks
        return to their owners; a home replica waits to start again."""
        drv = self.drv
        if rs.guest:
            drv.loans.release_guest(rs, now)
            return
        drv.charge_kv(rs, now)
        drv.fleet.retire(rs)
        drv.evict_weights(rs, now)
        self.waiting.append(rs.replica)

    def back(self, devices: tuple[int, ...], now: float) -> list[ReplicaState]:
        """Devices whose workers are back: home replicas all of whose devices are up start again."""
        self.down -= set(devices)
        out = []
        for r in [r for r in self.waiting if self.down.isdisjoint(r.devices)]:
            self.waiting.remove(r)
            hit = self.drv.fleet.unpark(r.tenant)  # before `activate`, which admits fresh ones only
            rs = self.drv.moves.activate(r)
            for req in hit:
                if req.state is RequestState.WAITING and not req.num_preemptions:
                    self.drv.admit(rs, req)
                else:
                    rs.engine.adopt(req, now)
            out.append(rs)
        return out

    def apply(self, lost: tuple[int, ...], back: tuple[int, ...], now: float) -> list[ReplicaState]:
        """An outcome's lost and returning devices, then the open faults' recovery; returns the
        replicas that took requests or started again."""
        touched = (self.lost(lost, now) if lost else []) + (self.back(back, now) if back else [])
        if self.log and self.log[-1].recovered_s is None:
            self.tick(now)
        return touched

    def tick(self, now: float) -> None:
        """Close the faults whose requests have all caught up (called as iterations complete)."""
        for f in self.log:
            if f.recovered_s is not None:
                continue
            moved = [r.finish_s is not None or r.num_generated > n for r, n in f.requests]
            if f.resumed_s is None and (any(moved) or not moved):
                f.resumed_s = now - f.time_s
            if all(moved):
                f.recovered_s = now - f.time_s

    def report(self) -> dict[str, float]:
        """Figures for the run's report: faults, the requests they hit, and the slowest time to
        resume and to recover (s; NaN: not within the run)."""
        if not self.log:
            return {}

        def slowest(ts: list[float | None]) -> float:
            return float("nan") if None in ts else max(t for t in ts if t is not None)

        return {"faults": float(len(self.log)), "fault_requests": float(sum(len(f.requests) for f in self.log)),
                "fault_resume_s": slowest([f.resumed_s for f in self.log]),
                "fault_recovery_s": slowest([f.recovered_s for f in self.log])}
