"""Container-granularity baselines: how multi-tenant serving is scheduled today.

- `dedicated`: every tenant runs only on its own container(s) (one engine per model).
- `temporal-mux`: pairs of containers merge into one shared group on which both tenants'
  weights stay resident and their iterations are multiplexed (MuxServe-style co-location).
- `realloc`: an autoscaler that periodically moves a container from the least to the most
  loaded tenant, paying the drain, the weight load from host memory and the warm-up.
"""

from __future__ import annotations

from slicesched.gmg.builder import block_weight_bytes
from slicesched.gmg.graph import GlobalMappingGraph
from slicesched.models.spec import model_spec
from slicesched.sched.interface import (SCHEDULERS, ContainerMove, Scheduler, SchedulerDecision, ServingView,
                                        SlicePlacement)


def home_placements(gmg: GlobalMappingGraph) -> tuple[SlicePlacement, ...]:
    """Each newly ready iteration, all its remaining slices, on its home group (one object each)."""
    out = []
    homes = gmg.col("home")
    for s in gmg.unmapped_ready().tolist():
        it, local = gmg.iteration_of(s)
        out.append(SlicePlacement(s, int(homes[s & gmg.mask]), it.graph.num_slices - local))
    return tuple(out)


@SCHEDULERS.register("dedicated")
class DedicatedScheduler(Scheduler):
    name = "dedicated"

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        return SchedulerDecision(now, home_placements(gmg))


Replicas = tuple[tuple[str, tuple[int, ...]], ...]


def _tp_ok(model: str, tp: int) -> bool:
    m = model_spec(model)
    return m.heads % tp == 0 and (m.kv_heads % tp == 0 or m.kv_heads < tp) and m.intermediate % tp == 0


@SCHEDULERS.register("temporal-mux")
class TemporalMuxScheduler(Scheduler):
    """Co-locates pairs of same-size containers: both tenants shard over the union of devices."""

    name = "temporal-mux"

    def __init__(self, models: dict[str, str] | None = None, capacity_bytes: float = 80e9,
                 utilization: float = 0.9) -> None:
        self.models = models or {}
        self.capacity = capacity_bytes
        self.utilization = utilization

    @classmethod
    def from_scenario(cls, scenario) -> "TemporalMuxScheduler":
        from slicesched.hardware.specs import device_spec

        return cls({t.name: t.model for t in scenario.tenants},
                   device_spec(scenario.cluster.device).memory_bytes, scenario.replay.gpu_memory_utilization)

    def deployment(self, default: Replicas) -> Replicas:
        out, pending = [], list(default)
        while pending:
            t, devs = pending.pop(0)
            mate = next((p for p in pending if len(p[1]) == len(devs) and p[0] != t and self._fits(t, p[0], devs + p[1])), None)
            if mate is None:
                out.append((t, devs))
                continue
            pending.remove(mate)
            union = tuple(sorted(devs + mate[1]))
            out += [(t, union), (mate[0], union)]
        return tuple(out)

    def _fits(self, a: str, b: str, devices: tuple[int, ...]) -> bool:
        """Both models shard over the union and their weights leave >= 20% of it for KV."""
        if a not in self.models or b not in self.models:
            return False
        tp = len(devices)
        if not (_tp_ok(self.models[a], tp) and _tp_ok(self.models[b], tp)):
            return False
        w = sum(block_weight_bytes(model_spec(self.models[x]), tp).sum() for x in (a, b))
        return w <= 0.8 * self.capacity * self.utilization

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        return SchedulerDecision(now, home_placements(gmg))


@SCHEDULERS.register("realloc")
class ReallocScheduler(Scheduler):
    """Every `interval_s`, moves one replica from the least pressured tenant that has a spare
    one to the most pressured tenant, if the pressure gap is large (hysteresis)."""

    name = "realloc"

    def __init__(self, interval_s: float = 30.0, min_gap: float = 4.0, target_load: float = 16.0) -> None:
        self.interval_s = interval_s
        self.min_gap = min_gap  # hot pressure must exceed the donor's by this factor
        self.target_load = target_load  # requests per replica above which a tenant wants more
        self._next = interval_s
        self._view: ServingView | None = None

    @classmethod
    def from_scenario(cls, scenario) -> "ReallocScheduler":
        return cls(scenario.replay.realloc_interval_s)

    def attach(self, view: ServingView) -> None:
        self._view = view

    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        moves: tuple[ContainerMove, ...] = ()
        if self._view is not None and now >= self._next:
            self._next = now + self.interval_s
            move = self._pick_move()
            moves = (move,) if move else ()
        return SchedulerDecision(now, home_placements(gmg), container_moves=moves)

    def _pick_move(self) -> ContainerMove | None:
        """Pressure = queued + running requests per active replica (what request-based
        autoscalers such as Knative's concurrency target watch)."""
        reps = [r for r in self._view.replica_loads() if not r.draining]
        per: dict[str, list] = {}
        for r in reps:
            per.setdefault(r.tenant, []).append(r)
        pressure = {t: sum(x.waiting + x.running for x in rs) / len(rs) for t, rs in per.items()}
        hot = max(pressure, key=pressure.get, default=None)
        if hot is None or pressure[hot] < self.target_load:
            return None
        size = len(per[hot][0].devices)
        donors = [t for t, rs in per.items() if t != hot and len(rs) > 1 and len(rs[0].devices) == size
                  and pressure[hot] >= self.min_gap * max(pressure[t], 1.0)]
        if not donors:
            return None
        cold = min(donors, key=pressure.get)
        victim = min(per[cold], key=lambda x: x.waiting + x.running)
        return ContainerMove(victim.devices, cold, hot)
