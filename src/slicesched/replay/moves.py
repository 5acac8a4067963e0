"""What the `realloc` baseline's container moves do to replicas: a moved replica drains, its
devices load the new tenant's weights from host memory, and the new replica starts serving once
loaded. The replicas themselves are the fleet's; this keeps the count of moves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slicesched.decisions import ContainerMove
from slicesched.gmg import block_weight_bytes
from slicesched.replay.deployment import Replica, kv_pool_bytes
from slicesched.replay.replicas import ReplicaState, least_loaded

if TYPE_CHECKING:
    from slicesched.replay.driver import ReplayDriver


class Moves:
    """Container moves (the `realloc` baseline) for one replay."""

    def __init__(self, driver: "ReplayDriver") -> None:
        self.drv = driver
        self.count = 0  # moves started

    def apply(self, moves: tuple[ContainerMove, ...]) -> None:
        """Start each move: the replica takes no new requests, its queued ones go to the tenant's
        other replicas at once (a load balancer re-routes them), its running ones finish. A
        tenant's last replica may go (scale to zero): its later arrivals park until it has one."""
        drv = self.drv
        now = drv.backend.now
        for mv in moves:
            rs = next((r for r in drv.fleet if r.replica.tenant == mv.from_tenant and not r.guest
                       and r.replica.devices == tuple(mv.devices) and not r.draining), None)
            if rs is None:
                continue
            rs.drain(move_to=mv.to_tenant)
            self.count += 1
            rest = [r for r in drv.fleet.of(mv.from_tenant) if not r.draining]
            if rest:
                for req in rs.engine.take_waiting(rs.engine.num_waiting):
                    least_loaded(rest).engine.adopt(req, now)
            if not rs.engine.has_work() and rs.engine.num_inflight == 0:
                self.finish_drain(rs, now)

    def finish_drain(self, rs: ReplicaState, t: float) -> None:
        """Free the drained replica's devices and start loading the new model from host memory
        (a cache of every served model's weights in host DRAM, as ServerlessLLM keeps)."""
        drv = self.drv
        drv.fleet.retire(rs)
        tenant, devs = rs.replica.tenant, rs.replica.devices
        drv.evict_weights(rs, t)
        if rs.kv_charged > 0:
            drv.backend.free_kv(devs, rs.kv_charged, tenant)
        new = Replica(rs.move_to or tenant, devs)
        per_dev = float(block_weight_bytes(drv.models[new.tenant], new.tp).sum())
        # every device loads its shard from host memory over its own PCIe link, in parallel
        load_s = max(drv.cost.transfer_time(per_dev, drv.cluster.host_link(d)) for d in devs)
        drv.events.loaded(t + load_s + drv.sc.schedulers.realloc.warmup_s, new)

    def activate(self, r: Replica) -> ReplicaState:
        """A replica whose model finished loading starts serving; arrivals parked for it go in."""
        drv = self.drv
        others = [o.replica for o in drv.fleet] + [r]
        pool = kv_pool_bytes(others, drv.models, drv.gmg.capacity_bytes, drv.sc.replay.gpu_memory_utilization)[-1]
        rs = drv.start_replica(r, pool)
        drv.fleet.enlist(rs)
        for req in drv.fleet.unpark(r.tenant):  # cold start over: parked arrivals go in
            drv.admit(rs, req)
        return rs
