"""Per-request SLOs come from the model, the container and the request's own prompt alone."""

import textwrap
import tomllib

import numpy as np
import pytest

from slicesched.config import parse_scenario
from slicesched.cost import make_cost_model
from slicesched.hardware import DEVICES, LINKS
from slicesched.models.spec import model_spec
from slicesched.replay.experiment import RunSpec, run_one
from slicesched.replay.slo import ContainerLatency, isolated_slas
from slicesched.gmg import BatchShape, build_iteration

SCENARIO = textwrap.dedent("""
    [cluster]
    devices_per_node = 2
    [[tenants]]
    name = "a"
    model = "qwen2.5-1.5b"
    max_batch_tokens = 2048
    [[tenants]]
    name = "b"
    model = "qwen2.5-1.5b"
    ttft_slo_s = 0.75
    [[streams]]
    source = "synthetic"
    tenants = ["a", "b"]
    rate = 6.0
    prompt_mean = 512
    output_mean = 8
    [replay]
    duration_s = 2
    drain_s = 10
""")


@pytest.fixture(scope="module")
def sc():
    return parse_scenario(tomllib.loads(SCENARIO))


def test_isolated_latency_is_the_prompts_own_chunked_prefill_and_one_decode():
    cost, m, dev, link = make_cost_model(), model_spec("qwen2.5-1.5b"), DEVICES["H100-80GB"], LINKS["local"]

    def secs(new, ctx):
        return cost.op_times(build_iteration(m, BatchShape(np.array([new]), np.array([ctx]), 1), 1), dev, link).sum()

    lat = ContainerLatency(m, 1, 2048, cost, dev, link)
    by_hand = secs(2048, 0) + secs(2048, 2048) + secs(904, 4096)  # 5000 tokens in chunks of 2048
    assert lat.ttft(np.array([5000, 10]))[0] == pytest.approx(by_hand, rel=1e-12)
    assert lat.tpot(np.array([5000]))[0] == pytest.approx(secs(1, 5000), rel=1e-12)


def test_one_prompt_is_priced_as_among_others_and_keeps_its_shape():
    """A single prompt (an arrival routed, a prefill step observed) takes a shortcut past the
    batch path's sort: same seconds, same shape, whichever path priced the length first."""
    m, dev, link = model_spec("qwen2.5-1.5b"), DEVICES["H100-80GB"], LINKS["local"]
    batch_first, one_first = (ContainerLatency(m, 1, 2048, make_cost_model(), dev, link) for _ in range(2))
    among = batch_first.ttft(np.array([700, 5000, 700]))
    alone = [one_first.ttft([5000]), one_first.ttft(np.array([[700]])), one_first.ttft(np.array(700))]
    assert [a.shape for a in alone] == [(1,), (1, 1), ()]
    assert [float(a.reshape(-1)[0]) for a in alone] == [among[1], among[0], among[0]]
    assert batch_first.ttft([5000])[0] == among[1] and one_first.ttft(np.array([700, 5000]))[1] == among[1]


def test_slos_grow_with_the_prompt_beyond_any_grid(sc):
    sla = isolated_slas(sc, make_cost_model())["a"]
    ttft = sla.ttft_for(np.array([1000, 30000, 31000]))
    assert ttft[0] < ttft[1] < ttft[2]  # nothing clamped at a largest grid point


def test_absolute_slo_of_a_tenant_is_kept(sc):
    assert isolated_slas(sc, make_cost_model())["b"].ttft_for(np.array([10, 9000])).tolist() == [0.75, 0.75]


def test_slos_are_equal_for_two_durations_and_rate_scales(sc):
    """The same request (same prompt) gets the same SLOs in a 2 s run at x1 and a 4 s run at x3."""
    a = run_one(sc, RunSpec("dedicated", 1.0), duration_s=2.0).requests
    b = run_one(sc, RunSpec("dedicated", 3.0), duration_s=4.0).requests
    assert len(b) > len(a) > 5
    sla_a = isolated_slas(sc, make_cost_model())
    sla_b = isolated_slas(sc.model_copy(update={"replay": sc.replay.model_copy(update={"duration_s": 4.0})}),
                          make_cost_model())
    for t in ("a", "b"):
        p = b.loc[b.tenant == t, "prompt_tokens"].to_numpy()
        assert np.array_equal(sla_a[t].ttft_for(p), sla_b[t].ttft_for(p))
        assert np.array_equal(sla_a[t].tpot_for(p), sla_b[t].tpot_for(p))
    # prefix-nested: the x1 requests are the first x3 ones, with the same prompts
    n = len(a)
    assert a["prompt_tokens"].tolist() == b["prompt_tokens"].tolist()[:n]


def test_isolated_latency_on_two_stages_adds_the_activation_send():
    """Alone, a step runs stage 0, sends the hidden states of its tokens, then runs stage 1."""
    cost, m, dev, link = make_cost_model(), model_spec("qwen2.5-1.5b"), DEVICES["H100-80GB"], LINKS["local"]
    one = ContainerLatency(m, 1, 2048, cost, dev, link)
    two = ContainerLatency(m, 1, 2048, cost, dev, link, pp=2, stage_links=(LINKS["nvlink4"],))
    send = cost.transfer_time(900 * m.hidden * m.dtype_bytes, LINKS["nvlink4"])
    assert two.ttft(np.array([900]))[0] == pytest.approx(one.ttft(np.array([900]))[0] + send, rel=1e-12)
    assert two.tpot(np.array([900]))[0] == pytest.approx(
        one.tpot(np.array([900]))[0] + cost.transfer_time(m.hidden * m.dtype_bytes, LINKS["nvlink4"]), rel=1e-12)


def test_a_tenants_slo_class_reaches_its_sla_and_the_replay_judges_by_it(sc):
    text = (SCENARIO.replace('name = "b"\nmodel = "qwen2.5-1.5b"\nttft_slo_s = 0.75',
                             'name = "b"\nmodel = "qwen2.5-1.5b"\nslo_class = "batch"\ndeadline_s = 0.001')
            .replace('name = "a"\nmodel = "qwen2.5-1.5b"', 'name = "a"\nmodel = "qwen2.5-1.5b"\nslo_class = "reasoning"'))
    classed = parse_scenario(tomllib.loads(text))
    slas = isolated_slas(classed, make_cost_model())
    assert (slas["a"].slo_class, slas["b"].slo_class, slas["b"].deadline_s) == ("reasoning", "batch", 0.001)
    r = run_one(classed, RunSpec("dedicated", 1.0))
    b = r.summary.tenant("b")
    assert b.judged > 0 and b.violations == b.judged  # nothing finishes within a millisecond
