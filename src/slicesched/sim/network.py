"""Transfers over shared link resources with fair bandwidth sharing.

Resources (each with one bandwidth, per direction):
- ("nv", a, b): the intra-node path from device a to device b (NVLink through the switch);
- ("out", a) / ("in", b): device a's network egress and device b's ingress (one NIC per device,
  as on DGX-class nodes), used together for inter-node transfers;
- ("h2d", b): the host-to-device PCIe path of device b (weight copies from host memory).

A flow first waits out the path latency, then streams its bytes. While streaming, every flow on
a resource gets an equal share of it and a flow moves at the smallest share among its resources
(equal split, not max-min water-filling: simpler, deterministic, and exact for the common case of
flows that share one bottleneck). Whenever flows join or leave a resource, the other flows on it
are brought up to date and get a new projected end, so their old end events go stale (a version
number tells). The re-projection happens once per instant (`flush`, which the simulator calls
before its clock moves on), not once per join or close: a stage's weight blocks open together,
and re-sharing after each of n joins cost O(n^2); rates over a zero-length stretch move no bytes,
so the result is the same to the bit. Effective bandwidth and latency of a link come from the
cost model, fitted on two sizes, so a lone transfer takes exactly `cost.transfer_time(nbytes, link)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slicesched.cost.model import CostModel
from slicesched.hardware.cluster import Cluster
from slicesched.hardware.specs import LinkSpec
from slicesched.sim.events import Event, Prio

FlowKey = tuple[int, int, int]  # (kind, a, b): (0, producer, consumer) | (1, tenant<<20 | block, dst)
Resource = tuple
ACT, WEIGHT = 0, 1


@dataclass(slots=True)
class Flow:
    """One transfer in flight; mutable, copied when the simulator forks."""

    key: FlowKey
    nbytes: float
    latency: float
    resources: tuple[Resource, ...]
    dst: tuple[int, ...]  # devices that receive (and hold a buffer of) `nbytes` each
    start: float
    remaining: float = 0.0
    rate: float = 0.0  # bytes/s while streaming; 0 during the latency phase
    last: float = 0.0  # when `remaining` was last brought up to date
    end: float = float("inf")
    version: int = 0
    joined: bool = False
    src: tuple[int, ...] = field(default=())  # source devices (-1: host)

    def copy(self) -> "Flow":
        return Flow(self.key, self.nbytes, self.latency, self.resources, self.dst, self.start, self.remaining,
                    self.rate, self.last, self.end, self.version, self.joined, self.src)

    def state(self) -> tuple:
        return (self.key, self.nbytes, self.start, self.remaining, self.rate, self.last, self.end, self.joined)


def fit_link(cost: CostModel, link: LinkSpec) -> tuple[float, float]:
    """(effective bandwidth, latency) such that cost.transfer_time(n, link) == latency + n / bandwidth."""
    t1, t2 = cost.transfer_time(1e9, link), cost.transfer_time(2e9, link)
    bw = 1e9 / (t2 - t1)
    return bw, t1 - 1e9 / bw


class Paths:
    """Which resources and latency a transfer between device sets uses (shared by forks)."""

    def __init__(self, cluster: Cluster, cost: CostModel) -> None:
        self.cluster = cluster
        self.cost = cost
        self.capacity: dict[Resource, float] = {}
        self._latency: dict[Resource, float] = {}
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[Resource, ...], float]] = {}

    def between(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[Resource, ...], float]:
        """Resources and latency to give every device of `dst` a copy from `src` (device i of dst
        reads from device i mod |src| of src; -1 in src is host memory). Empty when no bytes move."""
        hit = self._cache.get((src, dst))
        if hit is None:
            res: list[Resource] = []
            for i, b in enumerate(dst):
                res += self._pair(src[i % len(src)], b)
            uniq = tuple(dict.fromkeys(res))
            hit = self._cache[(src, dst)] = (uniq, max((self._latency[r] for r in uniq), default=0.0))
        return hit

    def _pair(self, a: int, b: int) -> list[Resource]:
        if a == b:
            return []
        if a < 0:
            return [self._add(("h2d", b), self.cluster.host_link(b))]
        if self.cluster.device_node[a] == self.cluster.device_node[b]:
            return [self._add(("nv", a, b), self.cluster.link(a, b))]
        # each end's own network: the flow moves at the slower share of the two
        return [self._add(("out", a), self.cluster.network(a)), self._add(("in", b), self.cluster.network(b))]

    def _add(self, r: Resource, link: LinkSpec) -> Resource:
        if r not in self.capacity:
            self.capacity[r], self._latency[r] = fit_link(self.cost, link)
        return r


class Network:
    """Flows in flight and the resources they share. Methods return new events, never push."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.flows: dict[FlowKey, Flow] = {}
        self.on: dict[Resource, list[FlowKey]] = {}
        self.dirty: set[Resource] = set()  # resources whose flows changed this instant (see flush)
        self._links: set[frozenset[int]] | None = None  # device sets of the flows in flight (cache)

    def copy(self, focus: frozenset[int] | None = None) -> "Network":
        """An independent copy; with `focus` (a device set no flow straddles), only the flows
        into those devices (a flow's resources are its own devices', so no other flow shares them)."""
        n = Network(self.paths)
        if focus is None:
            n.flows = {k: f.copy() for k, f in self.flows.items()}
            n.on = {r: list(v) for r, v in self.on.items() if v}
        else:  # a resource's list is only ever counted and searched: its order does not matter
            n.flows = {k: f.copy() for k, f in self.flows.items() if f.dst[0] in focus}
            for k, f in n.flows.items():
                if f.joined:
                    for r in f.resources:
                        n.on.setdefault(r, []).append(k)
        n.dirty = set(self.dirty)
        return n

    def open(self, flow: Flow, now: float) -> list[Event]:
        """Start a flow: its latency phase ends with an XFER_JOIN event."""
        flow.remaining, flow.last = flow.nbytes, now
        self.flows[flow.key] = flow
        self._links = None
        return [(now + flow.latency, Prio.XFER_JOIN, flow.key, flow.version)]

    def join(self, key: FlowKey, now: float) -> None:
        """Latency elapsed: the flow starts streaming and takes its share of its resources (at
        the next `flush`)."""
        f = self.flows[key]
        f.joined = True
        for r in f.resources:
            self.on.setdefault(r, []).append(key)
        self._mark(f.resources, now)

    def close(self, key: FlowKey, now: float) -> Flow:
        """Remove a finished (or cancelled) flow; the flows it shared with speed up (at the next
        `flush`)."""
        f = self.flows.pop(key)
        self._links = None
        if f.joined:
            for r in f.resources:
                self.on[r].remove(key)
            self._mark(f.resources, now)
        return f

    def links(self) -> set[frozenset[int]]:
        """The distinct device sets (source and destination devices) of the flows in flight."""
        if self._links is None:
            self._links = {frozenset(d for d in f.src + f.dst if d >= 0) for f in self.flows.values()}
        return self._links

    def touching(self, device: int) -> int:
        """Flows in flight into or out of `device` (for interference)."""
        return sum(1 for f in self.flows.values() if device in f.dst or device in f.src)

    def _mark(self, resources: tuple[Resource, ...], now: float) -> None:
        """Flows on these resources get new shares at `flush`; their end events are stale now,
        except those of flows that end at `now` anyway (their bytes are all through: a new share
        changes nothing, and re-projecting them would move their ends by rounding alone, one
        instant per flow, so n blocks of one size ending together would cost n flushes)."""
        dirty, flows = self.dirty, self.flows
        for r in resources:
            if r not in dirty:
                dirty.add(r)
                for k in self.on.get(r, ()):
                    f = flows[k]
                    if f.end > now:
                        f.version += 1

    def flush(self, now: float) -> list[Event]:
        """Give every flow on a changed resource its share and a new projected end (the end
        events); call once all joins and closes at `now` are done, before time moves on."""
        affected = sorted({k for r in self.dirty for k in self.on.get(r, ())})
        self.dirty.clear()
        events = []
        cap, on, flows = self.paths.capacity, self.on, self.flows
        share: dict[Resource, float] = {}  # each resource's equal share, computed once per flush
        for k in affected:
            f = flows[k]
            if f.end <= now:  # ends now, its event still current (see `_mark`)
                continue
            f.remaining = max(f.remaining - f.rate * (now - f.last), 0.0)
            f.last = now
            rate = float("inf")
            for r in f.resources:
                x = share.get(r)
                if x is None:
                    x = share[r] = cap[r] / len(on[r])
                if x < rate:
                    rate = x
            f.rate = rate
            f.end = now + f.remaining / rate
            f.version += 1
            events.append((f.end, Prio.XFER_END, k, f.version))
        return events
