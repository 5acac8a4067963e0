"""Capacity planning: the fewest GPUs of a device type, and their layout, that serve a scenario's
traffic (times a growth multiple) within its SLAs under a scheduler.

The search, stated in every report (`METHOD`):

1. Each tenant's container: the smallest tensor-parallel degree (a power of two up to the
   devices of a node, the tenant's own pipeline depth kept) at which its model shards and its
   weights plus one full-context request fit a device (`checks.fit_problem`, the load-time check).
2. A lower bound on the fleet: every tenant needs one container, and no fleet serves more than
   its roofline allows (`capacity.roofline_bound`: all the window's work at peak FLOP/s and HBM
   bandwidth), so at least (the scenario's GPUs x growth / its roofline bound) GPUs.
3. Fleet sizes from that bound upward (those layouts reach), galloping: the sizes 0, 1, 3, 7, ...
   steps above the bound until one meets the SLA, then every size of the gap below it. At each
   size, up to `layouts_per_size` layouts (replicas per tenant), the one whose GPUs follow the
   forecast's work shares most closely first, then its one-replica moves, each replayed at the
   growth multiple with every seed; a size meets when one of them has a mean SLA violation rate
   within `max_violation`. The answer is the smallest meeting size so found: the size just below
   it had each of its candidates fail, and every size skipped lies below a size where all failed
   (more GPUs of the same kind are assumed never to hurt). Replays are cached on disk by everything
   that decides them, so a rerun or a larger growth reuses them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from slicesched.config.scenario import Scenario
from slicesched.gmg.builder import tp_problem
from slicesched.hardware.specs import device_spec
from slicesched.replay.capacity import MAX_VIOLATION, roofline_bound
from slicesched.replay.checks import fit_problem
from slicesched.replay.deployment import tenant_demands
from slicesched.replay.workload import scenario_trace

METHOD = ("each tenant at its smallest fitting tp; sizes from a lower bound (one container per tenant, the "
          "roofline over the window's work) upward, galloping, then every size of the last gap; at each size the "
          "layouts closest to the forecast's work shares replayed with every seed; the smallest size with one "
          "within the SLA is the answer")

Layout = tuple[tuple[str, int, int], ...]  # per tenant: (name, tp, replicas)


@dataclass(frozen=True, slots=True)
class Probe:
    """One layout replayed with every seed."""

    layout: Layout
    gpus: int
    violation: float  # mean over seeds
    spread: tuple[float, float]  # lowest and highest seed
    meets: bool


@dataclass(frozen=True, slots=True)
class PlanResult:
    """The plan of one scheduler, device type and growth multiple."""

    scheduler: str
    device: str
    growth: float
    lower_bound: int
    found: Probe | None  # None: nothing within max_gpus met the SLA
    probes: tuple[Probe, ...]  # every layout replayed, in order
    price_per_gpu_hour: float
    problem: str = ""  # why nothing was searched (a tenant fits no container of this device)

    @property
    def gpus(self) -> int | None:
        return self.found.gpus if self.found else None

    @property
    def dollars_per_hour(self) -> float | None:
        return self.found.gpus * self.price_per_gpu_hour if self.found else None

    def smaller_failed(self) -> tuple[Probe, ...]:
        """The layouts of the largest size below the answer that were replayed (all failed)."""
        if self.found is None:
            return ()
        below = [p.gpus for p in self.probes if p.gpus < self.found.gpus]
        return tuple(p for p in self.probes if below and p.gpus == max(below))


@dataclass(frozen=True, slots=True)
class PlanSettings:
    seeds: tuple[int, ...] = (0, 1, 2)
    max_violation: float = MAX_VIOLATION
    duration_s: float | None = None  # arrival window; None: the scenario's


def node_shape(sc: Scenario, device: str) -> tuple[int, str]:
    """(devices per node, intra-node link) of the scenario's servers of `device` (of its first node
    group of that type in a mixed fleet; else the cluster's own)."""
    g = next((g for g in sc.cluster.node_groups if g.device == device), None)
    return (g.devices_per_node, g.intra_link) if g else (sc.cluster.devices_per_node, sc.cluster.intra_link)


def smallest_tp(sc: Scenario, tenant: int, device: str) -> int | None:
    """The tenant's smallest power-of-two tp (up to a node's devices) that shards and fits `device`."""
    t, dev = sc.tenants[tenant], device_spec(device)
    m = t.spec()
    tp = 1
    while tp <= node_shape(sc, device)[0]:
        if not tp_problem(m, tp) and not (m.expert_parallel and m.num_experts % tp) and not fit_problem(t.name, m, tp, t.pp, dev, sc.replay.gpu_memory_utilization):
            return tp
        tp *= 2
    return None


def layout_scenario(sc: Scenario, layout: Layout, device: str) -> Scenario:
    """The scenario served by `layout` on a fleet of its GPUs of `device` (nodes of the scenario's size)."""
    per_node, link = node_shape(sc, device)
    gpus = sum(tp * sc.tenants[i].pp * r for i, (_, tp, r) in enumerate(layout))
    cluster = sc.cluster.model_copy(update={"device": device, "node_groups": (), "devices_per_node": per_node,
                                            "intra_link": link, "nodes": math.ceil(gpus / per_node)})
    tenants = tuple(t.model_copy(update={"tp": tp, "replicas": r, "devices": None, "node_group": None})
                    for t, (_, tp, r) in zip(sc.tenants, layout))
    return sc.model_copy(update={"cluster": cluster, "tenants": tenants})


def _work_shares(sc: Scenario, settings: PlanSettings, growth: float) -> list[float]:
    """Each tenant's share of the forecast's work: requests/s x tokens x parameters."""
    window = settings.duration_s or sc.replay.duration_s
    demand = tenant_demands(scenario_trace(sc, growth, window), [t.name for t in sc.tenants])
    work = [demand[t.name].rate_rps * (demand[t.name].mean_prompt + demand[t.name].mean_output)
            * t.spec().num_params() for t in sc.tenants]
    total = sum(work)
    return [w / total for w in work] if total else [1 / len(work)] * len(work)


def candidates(cost: Sequence[int], shares: Sequence[float], gpus: int, limit: int) -> list[tuple[int, ...]]:
    """Up to `limit` replica counts (each >= 1) whose GPUs (count x cost) add up to `gpus`: the one
    following the work shares most closely first (largest deficit gets the next replica), then
    one-replica moves between tenants of equal cost, ordered by how far they stray."""
    base = sum(cost)
    if gpus < base:
        return []
    reps, left = [1] * len(cost), gpus - base
    while left > 0:
        fits = [i for i in range(len(cost)) if cost[i] <= left]
        if not fits:
            return []  # no layout of exactly this size from here
        i = max(fits, key=lambda i: (shares[i] * gpus / cost[i] - reps[i], -i))
        reps[i] += 1
        left -= cost[i]
    first = tuple(reps)
    moves = {first}
    for i in range(len(cost)):
        for j in range(len(cost)):
            if i != j and cost[i] == cost[j] and reps[i] > 1:
                r = list(reps)
                r[i] -= 1
                r[j] += 1
                moves.add(tuple(r))

    def stray(r: tuple[int, ...]) -> float:
        return sum(abs(r[i] * cost[i] / gpus - shares[i]) for i in range(len(cost)))

    return [first] + sorted(moves - {first}, key=lambda r: (stray(r), r))[:limit - 1]


def sizes(cost: Sequence[int], start: int, stop: int) -> Iterator[int]:
    """Fleet sizes in [start, stop] that some layout reaches (sums of the costs, each at least once)."""
    base = sum(cost)
    reach = {0}
    for n in range(1, stop - base + 1):
        if any(n - c in reach for c in cost):
            reach.add(n)
    return (base + n for n in sorted(reach) if start <= base + n <= stop)


class ProbeCache:
    """Replays of layouts on disk, keyed by everything that decides them (the scenario served, the
    scheduler, the growth multiple, the seed, the window, where a replay may stop and the
    package's version): a rerun or a larger growth reuses them."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.hits = self.misses = 0  # replays found and not found
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def key(self, sc: Scenario, scheduler: str, growth: float, seed: int, window: float, stop_above: float) -> str:
        from slicesched import __version__

        text = json.dumps([sc.model_dump(mode="json"), scheduler, growth, seed, window, stop_above, __version__],
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def get(self, key: str) -> float | None:
        if self.folder is None or not (self.folder / f"{key}.json").is_file():
            self.misses += 1
            return None
        self.hits += 1
        return float(json.loads((self.folder / f"{key}.json").read_text())["violation"])

    def put(self, key: str, violation: float) -> None:
        if self.folder is not None:
            tmp = self.folder / f"{key}.json.tmp"
            tmp.write_text(json.dumps({"violation": violation}))
            tmp.replace(self.folder / f"{key}.json")  # whole or not at all


def plan(sc: Scenario, scheduler: str, device: str, growth: float = 1.0, settings: PlanSettings = PlanSettings(),
         cache: ProbeCache | None = None, jobs: int = 1,
         on_probe: Callable[[Probe], None] | None = None) -> PlanResult:
    """The fewest GPUs of `device` serving the scenario's traffic x `growth` under `scheduler`."""
    cache = cache or ProbeCache(None)
    tps = [smallest_tp(sc, i, device) for i in range(len(sc.tenants))]
    price = sc.plan.price(device)
    if any(tp is None for tp in tps):
        i = tps.index(None)
        t = sc.tenants[i]
        per_node = node_shape(sc, device)[0]
        return PlanResult(scheduler, device, growth, 0, None, (), price,
                          f"tenant '{t.name}' ({t.model}) fits no container of up to {per_node} {device} (one node)")
    cost = [tp * t.pp for tp, t in zip(tps, sc.tenants)]
    lower = max(sum(cost), _roofline_gpus(sc, device, growth, settings))
    shares = _work_shares(sc, settings, growth)
    probes: list[Probe] = []

    def first_meeting(n: int) -> Probe | None:
        """Replay the candidate layouts of size n in order; the first that meets the SLA."""
        for reps in candidates(cost, shares, n, sc.plan.layouts_per_size):
            layout = tuple((t.name, tp, r) for t, tp, r in zip(sc.tenants, tps, reps))
            probe = _probe(sc, layout, n, scheduler, device, growth, settings, cache, jobs)
            probes.append(probe)
            if on_probe is not None:
                on_probe(probe)
            if probe.meets:
                return probe
        return None

    found = _gallop(list(sizes(cost, lower, sc.plan.max_gpus)), first_meeting)
    return PlanResult(scheduler, device, growth, lower, found, tuple(probes), price)


def _gallop(fleet_sizes: Sequence[int], first_meeting: Callable[[int], Probe | None]) -> Probe | None:
    """The smallest size with a layout meeting the SLA: the sizes 0, 1, 3, 7, ... places above the
    first until one meets (the last size is always tried), then every size of the gap below it,
    smallest first (so the size just below the answer had each of its candidates fail too)."""
    i, step, failed = 0, 1, -1
    while i < len(fleet_sizes):
        hit = first_meeting(fleet_sizes[i])
        if hit is not None:
            for j in range(failed + 1, i):
                inner = first_meeting(fleet_sizes[j])
                if inner is not None:
                    return inner
            return hit
        failed, last = i, len(fleet_sizes) - 1
        i = len(fleet_sizes) if i == last else min(i + step, last)  # past the end: none met
        step *= 2
    return None


def _probe(sc: Scenario, layout: Layout, gpus: int, scheduler: str, device: str, growth: float,
           settings: PlanSettings, cache: ProbeCache, jobs: int) -> Probe:
    """Replay one layout with every seed (cached replays reused)."""
    from slicesched.replay.experiment import RunSpec, run_many

    window = settings.duration_s or sc.replay.duration_s
    served = layout_scenario(sc, layout, device)
    keys = [cache.key(served, scheduler, growth, s, window, settings.max_violation) for s in settings.seeds]
    rates = {s: cache.get(k) for s, k in zip(settings.seeds, keys)}
    # a replay ends once it certainly fails (its rate is then a lower bound above the SLA's)
    todo = [RunSpec(scheduler, growth, seed=s, detail=False, stop_above=settings.max_violation)
            for s in settings.seeds if rates[s] is None]
    for spec, run in zip(todo, run_many(served, todo, jobs=jobs, duration_s=window) if todo else []):
        rates[spec.seed] = run.summary.overall.violation_rate
        cache.put(keys[settings.seeds.index(spec.seed)], rates[spec.seed])
    v = [rates[s] for s in settings.seeds]
    return Probe(layout, gpus, sum(v) / len(v), (min(v), max(v)), sum(v) / len(v) <= settings.max_violation)


def _roofline_gpus(sc: Scenario, device: str, growth: float, settings: PlanSettings) -> int:
    """Fewer GPUs of `device` cannot serve the traffic x growth: the roofline bound of a fleet of
    the scenario's size in that device scales with the fleet (its peaks are summed)."""
    per_node, link = node_shape(sc, device)
    fleet = sc.model_copy(update={"cluster": sc.cluster.model_copy(update={
        "device": device, "node_groups": (), "devices_per_node": per_node, "intra_link": link,
        "nodes": math.ceil(sc.cluster.num_devices / per_node)})})
    bound = roofline_bound(fleet, settings.duration_s, settings.seeds, settings.max_violation)
    n = fleet.cluster.num_devices
    return n if not bound.feasible else max(1, math.ceil(n * growth / bound.scale))
