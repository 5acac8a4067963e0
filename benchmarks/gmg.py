"""GMG build and query speed. Prints `name: value unit` lines (medians over repeats)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from slicesched.gmg import BatchShape, GlobalMappingGraph, Grain, build_iteration
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import model_spec


def median_us(fn, repeats: int = 200, inner: int = 5) -> float:
    fn()  # warm caches
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(samples)


def busy_cluster(seed: int = 0) -> GlobalMappingGraph:
    """64 devices, 16 tenants of 4 devices each, with a few hundred ms of executed history."""
    rng = np.random.default_rng(seed)
    cluster = Cluster.homogeneous("H100-80GB", 8, 8)
    names = [f"t{i}" for i in range(16)]
    specs = {n: model_spec(["llama-2-7b", "llama-3-8b", "qwen2.5-14b", "llama-2-13b"][i % 4]) for i, n in enumerate(names)}
    conts = {n: Container(n, tuple(range(4 * i, 4 * i + 4))) for i, n in enumerate(names)}
    gmg = GlobalMappingGraph(cluster, specs, conts)
    t = np.zeros(16)
    for _ in range(8):  # 8 iterations per tenant, random gaps between them (the idle slices)
        for i, n in enumerate(names):
            g = build_iteration(specs[n], BatchShape.decode(int(rng.integers(16, 128)), 500), tp=4,
                                grain=Grain.BLOCK, tenant=n)
            h = gmg.add_iteration(g, float(t[i]))
            gmg.map(h.slice_base, cluster.group_id(conts[n].devices), h.num_slices)
            t[i] += rng.exponential(0.01)
            for s in h.slice_ids():
                gmg.start(s, float(t[i]))
                t[i] += 2e-4
                gmg.finish(s, float(t[i]))
            gmg.retire(h.key)
    return gmg


def main() -> None:
    llama = model_spec("llama-3-8b")
    dec = BatchShape.decode(64, 1024)
    pre = BatchShape.prefill(2048)
    print(f"gmg_decode_build_us: {median_us(lambda: build_iteration(llama, dec, grain=Grain.BLOCK)):.1f} us")
    print(f"gmg_prefill_build_us: {median_us(lambda: build_iteration(llama, pre, grain=Grain.BLOCK)):.1f} us")
    # MoE graphs price their routing model at every build: Mixtral-8x22B at its 64k context (a
    # 64-sequence decode over 65,000 tokens each, and a 64k prefill), expert-parallel over 8
    # devices with skewed routing; the fine-grained Qwen1.5-MoE (60 experts) likewise over 2
    mixtral = dataclasses.replace(model_spec("mixtral-8x22b"), expert_parallel=True, routing_skew=0.5)
    fine = dataclasses.replace(model_spec("qwen1.5-moe-a2.7b"), expert_parallel=True, routing_skew=0.5)
    for name, m, tp, shape in (("moe_64k_decode", mixtral, 8, BatchShape.decode(64, 65000)),
                               ("moe_64k_prefill", mixtral, 8, BatchShape.prefill(65536)),
                               ("fine_moe_decode", fine, 2, BatchShape.decode(64, 8000))):
        print(f"gmg_{name}_build_us: {median_us(lambda: build_iteration(m, shape, tp=tp, grain=Grain.BLOCK)):.1f} us")
    cluster = Cluster.homogeneous("H100-80GB", 1, 8)
    gmg = GlobalMappingGraph(cluster, {"a": llama}, {"a": Container("a", (0,))})
    graph = build_iteration(llama, dec, grain=Grain.BLOCK, tenant="a")

    def add_and_retire() -> None:
        gmg.retire(gmg.add_iteration(graph).key)

    print(f"gmg_add_iteration_us: {median_us(add_and_retire):.1f} us")
    busy = busy_cluster()
    now = float(busy.busy.since(-np.inf)[2].max())
    horizon = (now - 0.1, now + 0.1)  # what a scheduler asks: recent past and near future
    print(f"gmg_idle_query_us: {median_us(lambda: busy.idle_intervals(*horizon), repeats=100):.1f} us")
    gaps = sum(len(s) for s, _ in busy.idle_intervals(*horizon))
    print(f"gmg_idle_query_gaps: {gaps} intervals")


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("gmg")
    main()
