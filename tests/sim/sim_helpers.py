"""Small real worlds for simulator tests: tiny models, clusters, random cases for properties."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from slicesched.cost import RooflineCostModel
from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, block_weight_bytes, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import ModelSpec
from slicesched.sched.interface import SchedulerDecision, SlicePlacement
from slicesched.sim import Prediction, Simulator
from slicesched.sim.contention import SharingModel

COST = RooflineCostModel()


def tiny(name: str = "tiny", layers: int = 2, hidden: int = 64) -> ModelSpec:
    return ModelSpec(name, "llama", hidden=hidden, layers=layers, heads=4, kv_heads=4, head_dim=hidden // 4,
                     intermediate=2 * hidden, vocab=256)


def world(tenants: dict[str, tuple[ModelSpec, tuple[int, ...]]], nodes: int = 1, per_node: int = 2,
          everywhere: bool = False) -> GlobalMappingGraph:
    """A GMG whose tenants own the given devices; `everywhere` also loads every tenant's weights
    (sharded for its own degree) on every device, so any placement finds them."""
    cluster = Cluster.homogeneous("H100-80GB", nodes, per_node)
    gmg = GlobalMappingGraph(cluster, {t: m for t, (m, _) in tenants.items()},
                             {t: Container(t, d) for t, (_, d) in tenants.items()})
    gmg.load_home_weights()
    if everywhere:
        for t, (m, devs) in tenants.items():
            per = block_weight_bytes(m, len(devs))
            for d in range(cluster.num_devices):
                for b, nb in enumerate(per):
                    gmg.add_weights(t, b, d, float(nb))
    return gmg


def whole(h, group: int) -> SchedulerDecision:
    return SchedulerDecision(0.0, (SlicePlacement(h.slice_base, group, h.num_slices),))


def same_prediction(a: Prediction, b: Prediction) -> None:
    """Field by field, exactly."""
    assert dict(a.iteration_end) == dict(b.iteration_end)
    assert dict(a.tenant_end) == dict(b.tenant_end)
    assert a.ooms == b.ooms
    np.testing.assert_array_equal(a.peak_memory, b.peak_memory)
    for x, y in [(a.slice_id, b.slice_id), (a.slice_group, b.slice_group), (a.slice_start, b.slice_start),
                 (a.slice_end, b.slice_end)]:
        np.testing.assert_array_equal(x, y)
    assert len(a.idle) == len(b.idle)
    for (s1, e1), (s2, e2) in zip(a.idle, b.idle):
        np.testing.assert_array_equal(s1, s2)
        np.testing.assert_array_equal(e1, e2)


# ---- random cases ------------------------------------------------------------------------------
@dataclass
class Case:
    gmg: GlobalMappingGraph
    decision: SchedulerDecision
    horizon: float
    streams: int
    slowdown: float
    kv: list[tuple[int, float, str]]  # (device, bytes, tenant) allocated before the decision
    sharing: SharingModel | None = None  # overlapping slices share SMs and bandwidth (replaces streams)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Random clusters, tiny models, iterations of every grain, runs placed on random groups,
    and KV allocations that leave little room so some slices run out of memory."""
    nodes, per = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_dev = nodes * per
    tenants = {}
    for i in range(draw(st.integers(1, 3))):
        tp = draw(st.sampled_from([1, 2] if n_dev >= 2 else [1]))
        devs = tuple(sorted(draw(st.permutations(range(n_dev)))[:tp]))
        m = tiny(f"m{i}", layers=draw(st.integers(1, 3)), hidden=draw(st.sampled_from([64, 128])))
        tenants[f"t{i}"] = (m, devs)
    gmg = world(tenants, nodes, per, everywhere=True)
    cluster = gmg.cluster
    placements = []
    for _ in range(draw(st.integers(1, 4))):
        t = draw(st.sampled_from(sorted(tenants)))
        m, devs = tenants[t]
        shape = draw(st.sampled_from(["decode", "prefill"]))
        bs = (BatchShape.decode(draw(st.integers(1, 64)), draw(st.integers(1, 512))) if shape == "decode"
              else BatchShape.prefill(draw(st.integers(1, 256)), draw(st.integers(1, 2))))
        grain = draw(st.sampled_from([Grain.OP, Grain.BLOCK, Grain.LAYER]))
        h = gmg.add_iteration(build_iteration(m, bs, tp=len(devs), grain=grain, tenant=t))
        cuts = sorted(set(draw(st.lists(st.integers(1, h.num_slices - 1), max_size=3)) if h.num_slices > 1 else []))
        bounds = [0, *cuts, h.num_slices]
        for a, b in zip(bounds, bounds[1:]):
            if draw(st.integers(0, 9)) == 0:
                continue  # left unmapped: it waits
            group_devs = tuple(sorted(draw(st.permutations(range(n_dev)))[: len(devs)]))
            placements.append(SlicePlacement(h.slice_base + a, cluster.group_id(group_devs), b - a))
    kv = []
    if draw(st.booleans()):
        for d in range(n_dev):
            room = draw(st.integers(0, 200_000))
            used = float(gmg.mem_used()[d])
            kv.append((d, float(gmg.capacity_bytes[d]) - used - room, sorted(tenants)[0]))
    streams, slowdown = draw(st.sampled_from([1, 1, 2, 3])), draw(st.sampled_from([0.0, 0.25]))
    sharing = None
    if streams > 2:  # spatial sharing, some tenants' SMs capped on device 0; tiny models' slices
        # hold few SMs, so a high floor makes overlapping ones contend
        caps = tuple((t, 0, draw(st.floats(0.01, 1.0))) for t in sorted(tenants) if draw(st.booleans()))
        sharing = SharingModel(streams=draw(st.integers(2, 3)), partitions=caps,
                               min_sm=draw(st.sampled_from([1 / 16, 0.6, 1.0])))
        streams, slowdown = 1, 0.0
    return Case(gmg, SchedulerDecision(0.0, tuple(placements)), draw(st.floats(5e-5, 3e-3)), streams, slowdown,
                kv, sharing)


def case_sim(c: Case, **kw) -> Simulator:
    sim = Simulator(c.gmg.fork(), COST, streams_per_device=c.streams, stream_slowdown=c.slowdown,
                    sharing=c.sharing, **kw)
    for d, nbytes, t in c.kv:
        sim.alloc_kv(d, nbytes, t)
    return sim
