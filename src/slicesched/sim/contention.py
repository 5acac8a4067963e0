"""Spatial sharing: slices that overlap on a device share its SMs and HBM bandwidth.

With `streams_per_device > 1` and a `SharingModel`, several slices run on one device at once
(MPS, CUDA stream priorities, green contexts) and progress at rates recomputed whenever a slice
starts or ends on one of their devices, as the network shares link bandwidth between flows.

The model, and what it assumes:

- Demand. Alone, a slice runs for its cost-model duration D. Over D it draws a share of the
  device's HBM bandwidth, `bytes / (bandwidth * D) / mem_ceiling`, and keeps a share of the SMs
  busy, `max(flops / (peak * D) / compute_ceiling, hbm share * sm_for_bandwidth)`: a compute-bound
  kernel fills every SM it can (the ceilings are the shares of peak FLOP/s and bandwidth a large
  kernel reaches, the roofline's `gemm_peak_eff` and `mem_eff`), and a memory-bound one needs
  only the SMs that keep HBM saturated (about half of them on A100/H100-class parts). Every slice
  holds at least `min_sm` of the SMs (its blocks occupy them even when launch-bound). Demands
  are clipped to [0, 1]: a slice alone always runs at rate 1, so with nothing overlapping the
  results are those of the one-stream simulator.
- Sharing. A slice running at rate r (its alone speed = 1) uses r times its demand of each
  resource. Slices of one priority share by progressive filling: all rates rise together until a
  resource is full or a slice reaches its cap, then the others go on (max-min fair, work
  conserving: two slices that want the same resource take as long together as in sequence;
  complementary ones, a prefill beside a decode, overlap).
- Priority. A slice is the device's owner's work (high priority) when its tenant owns one of
  its devices, or a device has no owner; otherwise it is a guest (low priority). High-priority
  slices are filled first; guests get what they leave. A GPU does not preempt a guest kernel's
  blocks already resident, so an owner's slice beside a guest runs `1 + owner_bound` times
  slower at most (the stated bound; the default 10% is a block of a low-priority kernel in
  flight and the L2 and HBM queues it shares, per the co-location measurements MuxServe and
  NanoFlow report); its lost share goes to the guests.
- Partitions. An SM share per (tenant, device) (an MPS active-thread percentage or a green
  context) caps that tenant's slices there: rate at most share / SM demand.
- A slice on several devices (tensor parallel) progresses at the lowest rate any of its
  devices gives it; the share it leaves unused on the others is not redistributed.

- Host cores (`host_cores`, off by default). Where devices are worker threads of one host (the
  executor's CPU devices: each device steps its slices in a thread of its own), a node's
  devices share its cores: a slice holds one thread on each of its devices there, and while T
  threads run on a node of C cores each runs at min(1, C / T) (the OS's time sharing, fair
  between threads). With `streams = 1` this is the whole model: one slice per device, slowed
  only when more devices step at once than the host has cores. `host_slowdown` adds what busy
  cores share besides time (memory bandwidth, caches): with all C busy each thread runs that
  much slower, with one busy not at all, linearly between (a calibration measures it: the same
  steps alone and C at once). `host_other_threads` counts threads besides the devices' that run
  all the time (a driver's): T devices' threads share the cores with them.

Not modelled: kernel-level interleaving within a slice, cache effects beyond the owner bound,
power or clock throttling under load; for host cores, threads that run only now and then
(copy workers, other processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from slicesched.sim.events import Event, Prio
from slicesched.sim.timing import graph_for_size, group_variant

if TYPE_CHECKING:
    from slicesched.gmg.graph import GlobalMappingGraph
    from slicesched.sim.engine import Simulator
    from slicesched.sim.state import Run
    from slicesched.hardware.cluster import Cluster
    from slicesched.hardware.specs import DeviceSpec
    from slicesched.sim.iterinfo import IterInfo
    from slicesched.sim.timing import TimingCache

HIGH, LOW = 0, 1
_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class SharingModel:
    """How overlapping slices share a device (see the module docstring)."""

    streams: int = 3  # slices one device runs at once (a guest never takes the last free one)
    owner_bound: float = 0.10  # an owner's slice beside guests runs at most this much slower
    compute_ceiling: float = 0.75  # share of peak FLOP/s a compute-bound kernel reaches
    mem_ceiling: float = 0.80  # share of HBM bandwidth a streaming kernel reaches
    sm_for_bandwidth: float = 0.5  # share of SMs that saturates HBM bandwidth
    min_sm: float = 1 / 16  # SMs any running slice holds
    # (tenant, device, SM share): MPS percentages / green contexts
    partitions: tuple[tuple[str, int, float], ...] = field(default=())
    host_cores: float = 0.0  # > 0: a node's devices are threads sharing this many cores
    host_slowdown: float = 1.0  # a thread's slowdown with every core busy (shared memory bandwidth, caches)
    host_other_threads: float = 0.0  # threads besides the devices' always running on each host (a driver's)

    def __post_init__(self) -> None:
        if self.streams < 2 and not (self.streams == 1 and self.host_cores > 0):
            raise ValueError(f"spatial sharing needs streams >= 2 (1 only with host_cores), got {self.streams}")
        if self.host_cores < 0:
            raise ValueError(f"host_cores must be >= 0 (0: not modelled), got {self.host_cores}")
        if self.host_other_threads < 0:
            raise ValueError(f"host_other_threads must be >= 0, got {self.host_other_threads}")
        if self.host_slowdown < 1:
            raise ValueError(f"host_slowdown must be >= 1, got {self.host_slowdown}")
        if self.owner_bound < 0:
            raise ValueError(f"owner_bound must be >= 0, got {self.owner_bound}")
        for name in ("compute_ceiling", "mem_ceiling", "sm_for_bandwidth", "min_sm"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        for tenant, device, share in self.partitions:
            if not 0 < share <= 1:
                raise ValueError(f"SM share of {tenant} on device {device} must be in (0, 1], got {share}")

    def share_of(self, tenant: str, device: int) -> float:
        for t, d, s in self.partitions:
            if t == tenant and d == device:
                return s
        return 1.0


def demand(flops: np.ndarray, nbytes: np.ndarray, dur: np.ndarray, spec: "DeviceSpec",
           model: SharingModel) -> tuple[np.ndarray, np.ndarray]:
    """(SM share, HBM share) of work doing `flops` and moving `nbytes` in `dur` seconds alone."""
    dur = np.maximum(dur, _EPS)
    compute = flops / (spec.peak_flops * dur) / model.compute_ceiling
    hbm = np.clip(nbytes / (spec.mem_bandwidth * dur) / model.mem_ceiling, 0.0, 1.0)
    return np.clip(np.maximum(compute, hbm * model.sm_for_bandwidth), model.min_sm, 1.0), hbm


class Demands:
    """Per-slice (SM share, HBM share) of an iteration on a group variant: a pure function of
    the iteration, the cluster and the cost model, so a simulator and its forks share one."""

    def __init__(self, model: SharingModel, timing: "TimingCache", cluster: "Cluster") -> None:
        self.model, self.timing, self.cluster = model, timing, cluster
        self._cache: dict[tuple[int, int], tuple[list[float], list[float]]] = {}

    def of(self, info: "IterInfo", group: int, local: int) -> tuple[float, float]:
        hit = self._cache.get((info.key, group))
        if hit is None:
            hit = self._cache[(info.key, group)] = self._compute(info, group)
        return hit[0][local], hit[1][local]

    def _compute(self, info: "IterInfo", group: int) -> tuple[list[float], list[float]]:
        (size, _, _), spec, _ = group_variant(self.cluster, group)
        g = graph_for_size(info.graph, info.model, size)
        dur = self.timing.get(info.key, info.graph, info.model, group).slice_arr
        if len(self._cache) >= 4096:  # finished iterations' entries: a bound, not a lifecycle
            self._cache.clear()
        sm, hbm = demand(g.slice_sum(g.flops), g.slice_sum(g.bytes_read + g.bytes_written), dur, spec, self.model)
        return sm.tolist(), hbm.tolist()


@dataclass(frozen=True, slots=True)
class Share:
    """A running slice as the sharing model sees it."""

    devs: tuple[int, ...]
    sm: float
    hbm: float
    prio: int
    caps: tuple[float, ...]  # rate cap on each of devs (partitions)


class Sharing:
    """Rates of the slices running on shared devices. Owns each running slice's `Share`, the
    slices on each device, their current rates and the work each has left (seconds at rate 1)."""

    def __init__(self, model: SharingModel, demands: Demands, owners: list[frozenset[str]]) -> None:
        self.model, self.demands, self.owners = model, demands, owners
        self.shares: dict[int, Share] = {}
        self.on: list[set[int]] = [set() for _ in owners]
        self.work: dict[int, list[float]] = {}  # slice -> [work left at `since`, since, rate]
        node = demands.cluster.device_node.tolist() if model.host_cores > 0 else None
        self.node_of: list[int] | None = node  # device -> node, where host cores are modelled
        self.node_devs = {n: tuple(d for d, m in enumerate(node) if m == n) for n in set(node)} if node else {}

    @classmethod
    def build(cls, model: SharingModel | None, timing: "TimingCache", gmg: "GlobalMappingGraph",
              owners: "Sequence[frozenset[str]] | None") -> "Sharing | None":
        """A simulator's sharing (None without a model); owners default to the GMG's containers."""
        if model is None:
            return None
        if owners is None:
            owners = owners_of(gmg.cluster.num_devices, ((t, c.devices) for t, c in gmg.containers.items()))
        return cls(model, Demands(model, timing, gmg.cluster), list(owners))

    def averaged(self, run: "Run", now: float) -> "Run":
        """A slice that ended, its scale its average over its whole run (it ran at several rates)."""
        return run._replace(scale=(now - run.start) / max(run.timing.slice_dur[run.local], 1e-300))

    def copy(self, keep: "Collection[int] | None" = None) -> "Sharing":
        f = Sharing.__new__(Sharing)
        f.model, f.demands, f.owners, f.node_of, f.node_devs = (self.model, self.demands, self.owners, self.node_of,
                                                               self.node_devs)
        f.shares = {s: sh for s, sh in self.shares.items() if keep is None or s in keep}
        f.on = [{s for s in on if s in f.shares} for on in self.on]
        f.work = {s: list(self.work[s]) for s in f.shares}
        return f

    def state(self) -> tuple:
        """What decides the future (a digest's part)."""
        return tuple(sorted((s, *w) for s, w in self.work.items()))

    def start(self, s: int, info: "IterInfo", local: int, group: int, devs: tuple[int, ...],
              work: float, now: float) -> dict[int, float]:
        """Slice s starts on devs with `work` seconds to do alone: the new end of every slice
        whose rate this changes, s's own included."""
        sm, hbm = self.demands.of(info, group, local)
        tenant = info.tenant
        caps = tuple(min(1.0, self.model.share_of(tenant, d) / sm) for d in devs)
        self.shares[s] = Share(devs, sm, hbm, self.priority(tenant, devs), caps)
        for d in devs:
            self.on[d].add(s)
        self.work[s] = [work, now, -1.0]  # no rate yet: always reported
        return self._rerate(devs, now)

    def alone(self, s: int, devs: tuple[int, ...], start: float, work: float) -> bool:
        """Has s run alone on its devices at its full rate since `start`, with `work` seconds to do
        then, where nothing beyond its devices sets its rate (no host cores)? Then it runs as in
        the one-stream simulator until a slice starts beside it, which splits the segment it may
        become (`Segments.touch`); `adopt` gives it back the same record, bit for bit."""
        w = self.work[s]
        return (self.node_of is None and w[2] == 1.0 and w[1] == start and w[0] == work
                and all(len(self.on[d]) == 1 for d in devs))

    def forget(self, s: int) -> None:
        """Drop s without re-rating its neighbours (a segment's first step: the segment times its
        steps, not this model; or, through `end`, before they are re-rated)."""
        sh = self.shares.pop(s)
        del self.work[s]
        for d in sh.devs:
            self.on[d].discard(s)

    def adopt(self, s: int, info: "IterInfo", local: int, group: int, devs: tuple[int, ...],
              start: float, work: float) -> None:
        """The step a segment left running (alone, at rate 1 since `start`) is timed here again."""
        self.start(s, info, local, group, devs, work, start)  # alone: rate 1, its end unchanged

    def priority(self, tenant: str, devs: tuple[int, ...]) -> int:
        """HIGH where the tenant owns one of the devices (or one has no owner), else LOW (a guest)."""
        return HIGH if any(not self.owners[d] or tenant in self.owners[d] for d in devs) else LOW

    def end(self, s: int, now: float) -> dict[int, float]:
        """Slice s ended (or stopped): the new ends of the slices left beside it."""
        devs = self.shares[s].devs
        self.forget(s)
        return self._rerate(devs, now)

    def retime(self, s: int, factor: float, now: float) -> float:
        """Scale the work s has left by `factor` (a fork re-timing it from the cost model): its new end."""
        w = self._advance(s, now)
        w[0] *= factor
        return _end(w)

    def _advance(self, s: int, now: float) -> list[float]:
        w = self.work[s]
        if w[2] > 0 and now > w[1]:
            w[0] = max(0.0, w[0] - (now - w[1]) * w[2])
        w[1] = now
        return w

    def _rerate(self, devs: tuple[int, ...], now: float) -> dict[int, float]:
        if self.node_of is not None:  # a thread starting or ending changes every rate on its hosts
            devs = tuple({x for n in {self.node_of[d] for d in devs} for x in self.node_devs[n]})
        touched = {x for d in devs for x in self.on[d]}
        per_dev = {d: self._fill(d) for d in {d for x in touched for d in self.shares[x].devs}}
        host = self._host_rates(touched) if self.node_of is not None else None
        ends = {}
        for x in touched:
            r = min(per_dev[d][x] for d in self.shares[x].devs)
            if host is not None:
                r = min(r, min(host[self.node_of[d]] for d in self.shares[x].devs))
            w = self.work[x]
            if r != w[2]:
                self._advance(x, now)
                w[2] = r
                ends[x] = _end(w)
        return ends

    def _host_rates(self, touched: set[int]) -> dict[int, float]:
        """Per node of the touched slices: the rate of each device thread on it (`_thread_rate`)."""
        nodes = {self.node_of[d] for x in touched for d in self.shares[x].devs}
        return {n: self._thread_rate(sum(len(self.on[d]) for d in self.node_devs[n])) for n in nodes}

    def _thread_rate(self, devices: int) -> float:
        """A device thread's rate while `devices` of them run on a host (and its other threads):
        its share of the cores, slowed by the busy cores' contention (linear from none with one
        busy to `host_slowdown` with all)."""
        cores, slow = self.model.host_cores, self.model.host_slowdown
        threads = max(1, devices) + self.model.host_other_threads
        busy = min(threads, cores)
        if slow != 1.0 and cores > 1:
            slow = 1.0 + (slow - 1.0) * max(0.0, busy - 1.0) / (cores - 1.0)
        return min(1.0, cores / threads) / slow

    def _fill(self, d: int) -> dict[int, float]:
        """Rates on device d: owners filled first, guests from what is left."""
        on = sorted(self.on[d])
        high = [x for x in on if self.shares[x].prio == HIGH]
        low = [x for x in on if self.shares[x].prio == LOW]
        rates = self._fill_class(d, high, [1.0, 1.0]) if high else {}
        if low:
            guests = self._fill_class(d, low, self._left(high, rates))
            if high and any(r > 0 for r in guests.values()):
                # resident guest blocks delay the owner, up to the stated bound; guests take its loss
                slow = 1.0 / (1.0 + self.model.owner_bound)
                rates = {x: r * slow for x, r in rates.items()}
                guests = self._fill_class(d, low, self._left(high, rates))
            rates.update(guests)
        return rates

    def _left(self, xs: list[int], rates: dict[int, float]) -> list[float]:
        return [max(0.0, 1.0 - sum(rates[x] * self._demand(x)[k] for x in xs)) for k in (0, 1)]

    def _demand(self, x: int) -> tuple[float, float]:
        sh = self.shares[x]
        return sh.sm, sh.hbm

    def _fill_class(self, d: int, xs: list[int], left: list[float]) -> dict[int, float]:
        """Progressive filling: rates rise together until a resource fills or a slice hits its cap."""
        rates = {x: 0.0 for x in xs}
        caps = {x: self.shares[x].caps[self.shares[x].devs.index(d)] for x in xs}
        active = set(xs)
        avail = list(left)
        while active:
            step = min(caps[x] - rates[x] for x in active)
            full = []
            for k in (0, 1):
                slope = sum(self._demand(x)[k] for x in active)
                if slope > _EPS:
                    room = avail[k] / slope
                    if room < step:
                        step, full = room, [k]
                    elif room == step:
                        full.append(k)
            step = max(step, 0.0)
            for x in active:
                rates[x] += step
            for k in (0, 1):
                avail[k] -= step * sum(self._demand(x)[k] for x in active)
            done = {x for x in active if rates[x] >= caps[x] - _EPS}
            for k in full:
                done |= {x for x in active if self._demand(x)[k] > _EPS}
            if not done:  # float dust: nothing binds; stop rather than loop
                break
            active -= done
        return rates


def _end(w: list[float]) -> float:
    return w[1] + w[0] / w[2] if w[2] > 0 else float("inf")


def dispatch(sim: "Simulator") -> list["Event"]:
    """Start queued slices on shared devices: the owners' first (in queue order), then guests',
    each where its devices have a free stream; a guest never takes a device's last free stream,
    so an owner's next slice always finds one and waits for no guest."""
    share, free, queue = sim.share, sim._free, sim.queue
    if share.model.streams > 1:  # owners first, each in queue order
        ranked = sorted((share.priority(info.tenant, sim._devs(g)), i, s, g, info)
                        for i, (_, s, g, info) in enumerate(queue.items))
    else:  # one stream per device (host cores alone): queue order, as a device thread runs
        ranked = [(HIGH, i, s, g, info) for i, (_, s, g, info) in enumerate(queue.items)]
    ev: list[Event] = []
    for prio, _, s, g, info in ranked:
        devs = sim._devs(g)
        need = 1 if prio == HIGH else 2
        if all(free[d] >= need for d in devs):
            queue.drop(s)
            ev += sim._start(s, g, devs, info)
    return ev


def rerun(sim: "Simulator", ends: dict[int, float]) -> list["Event"]:
    """Running slices of `sim` whose rate changed end at these times now: their new end events."""
    ev: list[Event] = []
    for x in sorted(ends):
        ver = sim._next_version()
        r = sim._running[x]._replace(end=ends[x], version=ver)
        sim._set_run(x, r)
        ev.append((r.end, Prio.SLICE_END, x, ver))
    return ev


def owners_of(num_devices: int, placed: Iterable[tuple[str, tuple[int, ...]]]) -> list[frozenset[str]]:
    """Per device, the tenants placed on it as (tenant, devices) pairs (containers, replicas):
    their slices there are the owner's, any other tenant's a guest's."""
    owners: list[set[str]] = [set() for _ in range(num_devices)]
    for tenant, devices in placed:
        for d in devices:
            owners[d].add(tenant)
    return [frozenset(o) for o in owners]
