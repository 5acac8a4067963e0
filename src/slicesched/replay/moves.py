"""What the `realloc` baseline's container moves do to replicas, for the replay driver: a moved
replica drains, its devices load the new tenant's weights from host memory, and the new
replica starts serving once loaded (`MovesMixin`; the state is the driver's)."""

from __future__ import annotations

import math
from typing import Any

from slicesched.decisions import ContainerMove
from slicesched.gmg import block_weight_bytes
from slicesched.replay.deployment import Replica, kv_pool_bytes
from slicesched.replay.replicas import ReplicaState, least_loaded


class MovesMixin:
    """Container moves (the `realloc` baseline), for `ReplayDriver`."""

    def _apply_moves(self: Any, moves: tuple[ContainerMove, ...]) -> None:
        """Start each move: the replica takes no new requests, its queued ones go to the tenant's
        other replicas at once (a load balancer re-routes them), its running ones finish. A
        tenant's last replica may go (scale to zero): its later arrivals park until it has one."""
        now = self.backend.now
        for mv in moves:
            rs = next((r for r in self.replicas if r.replica.tenant == mv.from_tenant and not r.guest
                       and r.replica.devices == tuple(mv.devices) and not r.draining), None)
            if rs is None:
                continue
            rs.draining, rs.move_to = True, mv.to_tenant
            self.moves += 1
            rest = [r for r in self.replicas_of(mv.from_tenant) if not r.draining]
            if rest:
                for req in rs.engine.take_waiting(rs.engine.num_waiting):
                    least_loaded(rest).engine.adopt(req, now)
            if not rs.engine.has_work() and rs.engine.num_inflight == 0:
                self._finish_drain(rs, now)

    def _finish_drain(self: Any, rs: ReplicaState, t: float) -> None:
        """Free the drained replica's devices and start loading the new model from host memory
        (a cache of every served model's weights in host DRAM, as ServerlessLLM keeps)."""
        self.replicas.remove(rs)
        tenant, devs = rs.replica.tenant, rs.replica.devices
        self._evict_weights(rs, t)
        if rs.kv_charged > 0:
            self.backend.free_kv(devs, rs.kv_charged, tenant)
        new = Replica(rs.move_to or tenant, devs)
        per_dev = float(block_weight_bytes(self.models[new.tenant], new.tp).sum())
        # every device loads its shard from host memory over its own PCIe link, in parallel
        load_s = max(self.cost.transfer_time(per_dev, self.cluster.host_link(d)) for d in devs)
        self._activations.append((t + load_s + self.sc.schedulers.realloc.warmup_s, new))

    def _next_activation(self: Any) -> float:
        return min((t for t, _ in self._activations), default=math.inf)

    def _activate_loaded(self: Any, now: float) -> list[ReplicaState]:
        """Replicas whose model finished loading start serving."""
        ready = [(t, r) for t, r in self._activations if t <= now]
        if not ready:
            return []
        self._activations = [(t, r) for t, r in self._activations if t > now]
        started = []
        for _, r in ready:
            others = [o.replica for o in self.replicas] + [r]
            pool = kv_pool_bytes(others, self.models, self.gmg.capacity_bytes,
                                 self.sc.replay.gpu_memory_utilization)[-1]
            started.append(self._start_replica(r, pool))
            self.replicas.append(started[-1])
            for req in self._parked.pop(r.tenant, []):  # cold start over: parked arrivals go in
                self._admit(started[-1], req)
        return started
