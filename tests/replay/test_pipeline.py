"""Pipeline-parallel replicas in the replay: stage timings by hand, micro-batches, memory."""

import numpy as np
import pytest

from slicesched.gmg import BatchShape, Grain
from slicesched.gmg.stages import build_stages, stage_weight_bytes
from slicesched.hardware import LINKS
from slicesched.models.spec import model_spec
from slicesched.replay.deployment import Replica, build_cluster, default_replicas
from slicesched.replay.events import Kind
from slicesched.replay.driver import ReplayDriver
from slicesched.replay.pipeline import MicroBatch, Pipeline
from slicesched.sched import make_scheduler
from slicesched.traces import Trace
from scenario_helpers import scenario

OP_S = 1e-3  # every op takes a millisecond
BANDWIDTH = 1e9  # bytes/s over any link between devices


class KnownCost:
    """A cost model whose answers are known by hand: one price per op, one bandwidth."""

    prices_ops_alone = False

    def op_times(self, graph, device, group_link):
        return np.full(graph.num_ops, OP_S)

    def transfer_time(self, nbytes, link):
        return 0.0 if link is LINKS["local"] else nbytes / BANDWIDTH

    def allreduce_time(self, nbytes, group_size, link):
        return 0.0


def two_stage(pp=2, tp=1, devices=2, nodes=1, model="gpt2"):
    return scenario(f"""
        [cluster]
        nodes = {nodes}
        devices_per_node = {devices}
        [[tenants]]
        name = "a"
        model = "{model}"
        tp = {tp}
        pp = {pp}
        max_batch_tokens = 16
        [[streams]]
        source = "synthetic"
        tenants = ["a"]
        rate = 1.0
        [replay]
        perturbation_cv = 0.0  # durations exactly the cost model's
        grain = "layer"
    """)


def replay(sc, arrivals, prompts, outputs):
    trace = Trace.from_columns("t", arrivals, prompts, outputs, ["a"] * len(arrivals))
    drv = ReplayDriver(sc, make_scheduler("dedicated", sc), trace, cost=KnownCost())
    return drv, drv.run()


def stage_seconds(tokens=16):
    """gpt2 (12 layers, hidden 768, 2-byte weights) in two stages: the first holds the embedding
    and 6 layers, the last 6 layers, the final norm, LM head and sampling (3 ops more)."""
    m = model_spec("gpt2")
    whole = build_stages(m, BatchShape.prefill(tokens), 1, 1, Grain.LAYER)[0]
    per_layer = (whole.num_ops - 4) // 12
    s0, s1 = (1 + 6 * per_layer) * OP_S, (6 * per_layer + 3) * OP_S
    send = tokens * 768 * 2 / BANDWIDTH
    return s0, send, s1


def test_one_iteration_takes_stage_zero_then_the_send_then_stage_one():
    s0, send, s1 = stage_seconds()
    _, res = replay(two_stage(), [0.0], [16], [1])
    assert res.requests[0].ttft_s == pytest.approx(s0 + send + s1, rel=1e-12)


def test_two_micro_batches_overlap_behind_the_slower_stage():
    """Both prompts fill the 16-token budget, so they form two micro-batches: the second starts
    on stage 0 when the first leaves it, then waits for stage 1 (the bottleneck: 3 ops more)."""
    s0, send, s1 = stage_seconds()
    assert s1 > s0 + 0  # the second's send lands (2 s0 + send) before stage 1 is free
    _, res = replay(two_stage(), [0.0, 0.0], [16, 16], [1, 1])
    first, second = res.requests
    assert first.ttft_s == pytest.approx(s0 + send + s1, rel=1e-12)
    assert second.ttft_s == pytest.approx(s0 + send + 2 * s1, rel=1e-12)


def test_a_new_micro_batch_is_formed_when_stage_zero_can_take_it():
    """The second micro-batch forms when the first leaves stage 0, so both requests that arrived
    meanwhile ride in it (formed at the first arrival, it would have left the other behind)."""
    s0, send, s1 = stage_seconds()
    _, res = replay(two_stage(), [0.0, 0.001, 0.002], [16, 8, 8], [1, 1, 1])
    _, b, c = res.requests
    assert b.first_scheduled_s == c.first_scheduled_s == pytest.approx(s0, rel=1e-12)
    assert b.ttft_s + 0.001 == pytest.approx(s0 + send + 2 * s1, rel=1e-9)


def test_without_stages_the_same_two_batches_run_one_after_the_other():
    s0, _, s1 = stage_seconds()
    _, res = replay(two_stage(pp=1, devices=1), [0.0, 0.0], [16, 16], [1, 1])
    assert [r.ttft_s for r in res.requests] == pytest.approx([s0 + s1, 2 * (s0 + s1)], rel=1e-12)


def test_a_one_stage_replica_has_no_pipeline_and_one_batch_in_flight():
    drv, _ = replay(two_stage(pp=1, devices=1), [0.0], [16], [1])
    rs = drv.replicas[0]
    assert rs.pipe is None and rs.engine.max_inflight_batches == 1 and not drv._stage_runs


def test_stages_on_two_nodes_send_over_the_inter_node_link():
    """One device per node: the stages' groups are joined by the network, priced like any link."""
    sc = two_stage(devices=1, nodes=2)
    drv, res = replay(sc, [0.0], [16], [1])
    assert drv.replicas[0].pipe.links == (LINKS[sc.cluster.inter_link],)
    s0, send, s1 = stage_seconds()
    assert res.requests[0].ttft_s == pytest.approx(s0 + send + s1, rel=1e-12)


def test_each_stage_runs_on_its_own_devices():
    drv, res = replay(two_stage(), [0.0], [16], [4])
    busy = {d: (b[:, 1] - b[:, 0]).sum() for d, b in res.busy.items()}
    s0, _, s1 = stage_seconds()
    decode0, _, decode1 = stage_seconds(1)
    assert busy[0] == pytest.approx(s0 + 3 * decode0, rel=1e-9)
    assert busy[1] == pytest.approx(s1 + 3 * decode1, rel=1e-9)


def test_a_replica_keeps_at_most_pp_micro_batches_in_flight_with_disjoint_requests():
    sc = two_stage()
    trace = Trace.from_columns("t", np.linspace(0, 0.05, 12), np.full(12, 12), np.full(12, 6), ["a"] * 12)
    drv = ReplayDriver(sc, make_scheduler("dedicated", sc), trace, cost=KnownCost())
    seen = []
    launch = drv._launch

    def watched(rs, batch, now):
        launch(rs, batch, now)
        live = [b for _, b in drv.inflight.values()] + [mb.batch for _, (_, mb) in drv.events.pending(Kind.STAGE_SENT)]
        batches = {b.iteration: b for b in live}
        ids = [i for b in batches.values() for i in b.req_ids]
        seen.append((len(batches), len(ids) == len(set(ids))))

    drv._launch = watched
    res = drv.run()
    assert all(r.finish_s is not None for r in res.requests)
    assert max(n for n, _ in seen) == 2 and all(disjoint for _, disjoint in seen)


def test_weights_and_kv_on_each_device_are_its_stage_share():
    sc = two_stage(model="llama-2-7b")
    drv, _ = replay(sc, [0.0], [16], [1])
    m = model_spec("llama-2-7b")
    stage0, stage1 = (float(w.sum()) for w in stage_weight_bytes(m, 1, 2))
    assert drv.gmg.mem_weights.tolist() == pytest.approx([stage0, stage1])
    one_device = two_stage(pp=1, devices=1, model="llama-2-7b")
    whole = ReplayDriver(one_device, make_scheduler("dedicated", one_device),
                         Trace.from_columns("t", [0.0], [16], [1], ["a"]), cost=KnownCost())
    assert stage0 == pytest.approx(whole.gmg.mem_weights[0] / 2, rel=1e-3)
    rs = drv.replicas[0]
    assert rs.stage_kv == (m.kv_bytes_per_token() / 2, m.kv_bytes_per_token() / 2)
    # half the weights and half the KV per token on a device: more than twice the tokens
    assert rs.engine.kv.capacity_tokens > 2 * whole.replicas[0].engine.kv.capacity_tokens


def test_kv_of_a_launched_batch_is_charged_to_each_stage_for_its_layers():
    sc = two_stage(pp=3, devices=3, model="llama-2-7b")  # 32 layers: 11, 11, 10
    trace = Trace.from_columns("t", [0.0], [16], [1], ["a"])
    drv = ReplayDriver(sc, make_scheduler("dedicated", sc), trace, cost=KnownCost())
    rs = drv._route(drv.requests[0])
    drv._launch_batches(rs, 0.0)
    per_layer = model_spec("llama-2-7b").kv_bytes_per_token() / 32
    tokens = rs.engine.kv.used_blocks * rs.engine.kv.block_tokens
    assert drv.gmg.mem_kv.tolist() == pytest.approx([tokens * per_layer * n for n in (11, 11, 10)])


def test_stages_take_consecutive_devices_of_one_node_when_they_fit():
    sc = two_stage(pp=2, tp=2, devices=8, model="llama-2-7b")
    (_, devs), = default_replicas(sc, build_cluster(sc))
    assert Replica("a", devs, 2).stages == ((0, 1), (2, 3))


def test_a_stage_runs_its_micro_batches_in_arrival_order():
    pipe = Pipeline((0, 1), (LINKS["local"],))
    a, b, c = (MicroBatch(None, ()) for _ in range(3))  # noqa: the batch is not looked at
    assert pipe.arrive(a, 0) and not pipe.can_start()
    assert not pipe.arrive(b, 0) and not pipe.arrive(c, 0)
    assert pipe.leave(0) is b and pipe.leave(0) is c and pipe.leave(0) is None
    assert pipe.can_start()


@pytest.mark.parametrize("name", ["temporal-mux", "realloc", "slicesched"])
def test_schedulers_without_pipeline_support_are_refused(name):
    sc = two_stage()
    with pytest.raises(ValueError, match="pipeline-parallel"):
        ReplayDriver(sc, make_scheduler(name, sc), Trace.from_columns("t", [0.0], [16], [1], ["a"]))
