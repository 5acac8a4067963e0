
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicesched.replay.deployment import Replica, build_cluster, default_replicas, kv_pool_bytes
from slicesched.replay.workload import scenario_trace
from slicesched.models.spec import model_spec
from scenario_helpers import scenario


BASE = """
    [cluster]
    devices_per_node = 4
    nodes = 2
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    replicas = 2
    [[tenants]]
    name = "b"
    model = "llama-2-13b"
    tp = 2
    [[streams]]
    source = "synthetic"
    tenants = ["a", "b"]
    rate = 20.0
    popularity = "uniform"
    [replay]
    duration_s = 50
"""


def test_trace_covers_duration_and_labels_tenants():
    t = scenario_trace(scenario(BASE))
    assert set(t.tenants) == {"a", "b"}
    assert t.arrival_s.max() < 50 and len(t) == pytest.approx(1000, rel=0.15)


def test_rate_scale_keeps_window_and_multiplies_requests():
    sc = scenario(BASE)
    one, two = scenario_trace(sc, 1.0), scenario_trace(sc, 2.0)
    assert two.arrival_s.max() < 50
    assert len(two) == pytest.approx(2 * len(one), rel=0.1)


def test_trace_is_deterministic_for_the_seed():
    sc = scenario(BASE)
    assert np.array_equal(scenario_trace(sc).arrival_s, scenario_trace(sc).arrival_s)


def test_default_replicas_pack_tp_groups_inside_a_node():
    sc = scenario(BASE)
    reps = default_replicas(sc, build_cluster(sc))
    assert reps == (("a", (0,)), ("a", (1,)), ("b", (2, 3)))


def test_tp_group_moves_to_next_node_rather_than_straddle():
    sc = scenario(BASE.replace('replicas = 2', 'replicas = 3'))
    reps = default_replicas(sc, build_cluster(sc))
    assert reps[-1] == ("b", (4, 5))


def test_kv_pool_is_memory_left_after_weights():
    m = {"a": model_spec("llama-2-7b")}
    cap = np.array([80e9])
    (pool,) = kv_pool_bytes([Replica("a", (0,))], m, cap, 0.9)
    assert pool == pytest.approx(72e9 - m["a"].weight_bytes())


def test_colocated_replicas_split_the_kv_pool():
    m = {"a": model_spec("llama-2-7b"), "b": model_spec("llama-2-7b")}
    cap = np.array([80e9, 80e9])
    pools = kv_pool_bytes([Replica("a", (0, 1)), Replica("b", (0, 1))], m, cap, 0.9)
    assert pools[0] == pytest.approx(pools[1])
    assert pools[0] == pytest.approx((72e9 - m["a"].weight_bytes()) / 2, rel=1e-4)  # norms replicate


def test_trace_stream_reads_real_azure_file(shared_traces):
    sc = scenario(f"""
        [[tenants]]
        name = "a"
        model = "llama-2-7b"
        [[streams]]
        source = "trace"
        path = "{shared_traces / 'azure_llm_2023' / 'AzureLLMInferenceTrace_code.csv'}"
        format = "azure"
        tenants = ["a"]
        [replay]
        duration_s = 60
    """)
    t = scenario_trace(sc)
    assert 0 < len(t) < 8819 and t.arrival_s.max() < 60


# ---- prefix-nested rate scales ---------------------------------------------------------------

def assert_prefix(sc, k1: float, k2: float, duration: float | None = None) -> None:
    """The requests at k1 are the first ones at k2 with identical lengths and tenants, and their
    arrivals are the same stream times divided by k."""
    a, b = scenario_trace(sc, k1, duration), scenario_trace(sc, k2, duration)
    n = len(a)
    assert n <= len(b)
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens[:n])
    assert np.array_equal(a.output_tokens, b.output_tokens[:n])
    assert list(a.tenant) == list(b.tenant[:n])
    np.testing.assert_allclose(a.arrival_s * k1, b.arrival_s[:n] * k2, rtol=1e-12, atol=1e-9)


SYNTH_TWO_STREAMS = """
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    [[tenants]]
    name = "b"
    model = "llama-2-7b"
    [[streams]]
    source = "synthetic"
    tenants = ["a", "b"]
    rate = {rate}
    cv = {cv}
    [[streams]]
    source = "synthetic"
    tenants = ["b"]
    rate = 3.0
    cv = 2.0
    [replay]
    duration_s = 20
"""


@settings(max_examples=25, deadline=None)
@given(rate=st.floats(0.5, 50.0), cv=st.floats(0.3, 4.0), k1=st.floats(0.1, 4.0), ratio=st.floats(1.0, 6.0),
       seed=st.integers(0, 50))
def test_synthetic_rate_scales_are_prefix_nested(rate, cv, k1, ratio, seed):
    sc = scenario(SYNTH_TWO_STREAMS.format(rate=rate, cv=cv)).model_copy(update={"seed": seed})
    assert_prefix(sc, k1, k1 * ratio)


def test_synthetic_lengths_do_not_change_with_the_window():
    sc = scenario(SYNTH_TWO_STREAMS.format(rate=10.0, cv=3.0))
    short, long = scenario_trace(sc, 1.0, 5.0), scenario_trace(sc, 1.0, 50.0)
    assert len(short) > 20 and np.array_equal(short.prompt_tokens, long.prompt_tokens[:len(short)])


def test_seeds_give_different_samples():
    sc = scenario(SYNTH_TWO_STREAMS.format(rate=10.0, cv=3.0))
    a, b = scenario_trace(sc), scenario_trace(sc.model_copy(update={"seed": 1}))
    assert not np.array_equal(a.prompt_tokens[:10], b.prompt_tokens[:10])


def test_trace_stream_rate_scales_are_prefix_nested(shared_traces):
    sc = scenario(f"""
        [[tenants]]
        name = "a"
        model = "llama-2-7b"
        [[tenants]]
        name = "b"
        model = "llama-2-7b"
        [[streams]]
        source = "trace"
        path = "{shared_traces / 'azure_llm_2023' / 'AzureLLMInferenceTrace_conv.csv'}"
        tenants = ["a", "b"]
        start_s = 100
        [replay]
        duration_s = 30
    """)
    assert_prefix(sc, 0.5, 3.0)


def test_servegen_rate_scales_are_prefix_nested(shared_traces):
    sc = scenario(f"""
        [[tenants]]
        name = "a"
        model = "llama-2-7b"
        [[tenants]]
        name = "b"
        model = "llama-2-7b"
        [[streams]]
        source = "servegen"
        root = "{shared_traces / 'servegen' / 'data'}"
        model = "m-large"
        tenants = ["a", "b"]
        rate_scale = 0.5
        [replay]
        duration_s = 400
    """)
    assert_prefix(sc, 1.0, 2.5)  # spans cross a 600 s rate window of the data


MOONCAKE_TICKS = """
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    [[streams]]
    source = "trace"
    path = "{path}"
    format = "mooncake"
    tenants = ["a"]
    tick_s = {tick}
    [replay]
    duration_s = 30
"""


def test_a_ticked_trace_is_spread_over_each_tick_and_stays_prefix_nested(shared_traces):
    path = shared_traces / "mooncake_fast25" / "conversation_trace.jsonl"
    raw = scenario_trace(scenario(MOONCAKE_TICKS.format(path=path, tick=0.0)))
    spread = scenario(MOONCAKE_TICKS.format(path=path, tick=3.0))
    t = scenario_trace(spread)
    assert len(np.unique(raw.arrival_s)) * 5 < len(raw)  # ~10 requests per recorded instant
    assert len(np.unique(t.arrival_s)) == len(t)  # spread: no two at one instant
    assert np.all(np.floor(t.arrival_s / 3.0) * 3.0 <= t.arrival_s)
    assert_prefix(spread, 0.5, 2.0)
    again = scenario_trace(spread)
    assert np.array_equal(again.arrival_s, t.arrival_s)  # seeded


CURVED = """
    [cluster]
    devices_per_node = 2
    [[tenants]]
    name = "a"
    model = "llama-2-7b"
    [[streams]]
    source = "synthetic"
    tenants = ["a"]
    rate = 2.0
    prompt_mean = 64
    output_mean = 8
    {curve}
    [replay]
    duration_s = {duration}
"""


def _counts(trace, edges):
    return np.histogram(trace.arrival_s, bins=edges)[0]


def test_a_diurnal_curve_gives_the_expected_arrivals_per_hour():
    curve = '[[streams.curve]]\nkind = "diurnal"\nperiod_s = 86400\namplitude = 0.6'
    t = scenario_trace(scenario(CURVED.format(curve=curve, duration=86400)))
    hours = np.arange(25) * 3600.0
    # 2 requests/s x the integral of 1 + 0.6 sin(2 pi t / day) over each hour
    day = 2 * np.pi / 86400
    expected = 2.0 * (3600 + 0.6 / day * (np.cos(day * hours[:-1]) - np.cos(day * hours[1:])))
    got = _counts(t, hours)
    assert np.all(np.abs(got - expected) < 5 * np.sqrt(expected)), (got, expected.round())
    assert got[:12].sum() > 1.5 * got[12:].sum()  # the day's busy half is busy


FLASH = '[[streams.curve]]\nkind = "flash"\nat_s = 300\nheight = 6\nrise_s = 20\ndecay_s = 40'
# its multiplier over [310, 340] in closed form: 10 s of the rise (1 + 5 x 0.75 on average), then
# 20 s of the decay (1 + 5 x (40 / 20)(1 - e^-0.5) on average)
SURGE_MEAN = (10 * (1 + 5 * 0.75) + 20 * (1 + 5 * 2 * (1 - np.exp(-0.5)))) / 30


def test_a_flash_crowd_surges_where_it_was_asked_on_a_synthetic_stream():
    t = scenario_trace(scenario(CURVED.format(curve=FLASH, duration=600)))
    before, surge = _counts(t, [200, 260])[0], _counts(t, [310, 340])[0]
    assert before == pytest.approx(2 * 60, rel=0.35)
    assert surge == pytest.approx(2 * SURGE_MEAN * 30, rel=0.25) and surge > 3 * before / 2


def test_a_flash_crowd_reshapes_a_trace_keeping_every_request(tmp_path):
    path = tmp_path / "even.csv"
    rows = "\n".join(f"{i * 0.5},{100 + i},{10}" for i in range(4000))  # one every 0.5 s for 2000 s
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + rows + "\n")
    synthetic = 'source = "synthetic"\n    tenants = ["a"]\n    rate = 2.0\n    prompt_mean = 64\n    output_mean = 8'
    text = CURVED.format(curve=FLASH, duration=600).replace(synthetic, f'source = "trace"\n    path = "{path}"\n'
                                                                      '    tenants = ["a"]')
    assert 'source = "trace"' in text
    plain = scenario_trace(scenario(text.replace(FLASH, "")))
    warped = scenario_trace(scenario(text))
    assert len(warped) > len(plain)  # more of the trace fits the window
    n = len(warped)
    assert np.array_equal(warped.prompt_tokens, 100 + np.arange(n))  # the trace's requests, in order
    before, surge = _counts(warped, [200, 260])[0], _counts(warped, [310, 340])[0]
    assert before == pytest.approx(120, abs=2) and surge == pytest.approx(2 * SURGE_MEAN * 30, abs=2)


def test_rate_scales_stay_prefix_nested_under_a_curve():
    sc = scenario(CURVED.format(curve=FLASH, duration=600))
    one, two = scenario_trace(sc, 1.0), scenario_trace(sc, 2.0)
    assert len(two) > 1.6 * len(one)
    assert np.array_equal(two.prompt_tokens[:len(one)], one.prompt_tokens)
    assert np.array_equal(two.output_tokens[:len(one)], one.output_tokens)


def test_a_streams_max_tokens_caps_its_outputs_and_nothing_else():
    capped = BASE.replace('popularity = "uniform"', 'popularity = "uniform"\n    max_tokens = 64')
    plain, cut = scenario_trace(scenario(BASE)), scenario_trace(scenario(capped))
    assert plain.output_tokens.max() > 64 and cut.output_tokens.max() == 64
    assert np.array_equal(np.minimum(plain.output_tokens, 64), cut.output_tokens)
    assert np.array_equal(plain.prompt_tokens, cut.prompt_tokens) and np.array_equal(plain.arrival_s, cut.arrival_s)


def test_a_max_tokens_below_one_is_refused_naming_the_field():
    from slicesched.errors import InputError

    with pytest.raises(InputError, match="max_tokens"):
        scenario(BASE.replace('popularity = "uniform"', 'popularity = "uniform"\n    max_tokens = 0'))


def test_a_system_prompt_leads_every_prompt_and_shares_only_its_whole_blocks():
    sys_prompt = BASE.replace('popularity = "uniform"', 'popularity = "uniform"\n    system_prompt_tokens = 1100')
    plain, t = scenario_trace(scenario(BASE)), scenario_trace(scenario(sys_prompt))
    assert np.array_equal(t.prompt_tokens, plain.prompt_tokens + 1100)
    hashes = [tuple(h) for h in t.prefix_hashes]
    assert all(len(h) == -(-p // 512) for h, p in zip(hashes, t.prompt_tokens))
    assert len({h[:2] for h in hashes}) == 1  # two whole 512-token blocks of system prompt, shared
    own = [x for h in hashes for x in h[2:]]
    assert len(own) == len(set(own))  # the rest is each request's own


CONVERSATIONS = SYNTH_TWO_STREAMS.format(rate=4.0, cv=1.0).replace(
    "cv = 1.0", "cv = 1.0\n    system_prompt_tokens = 1100\n    turns_mean = 3\n    think_s = 2", 1)


def _by_conversation(t):
    """Requests of each conversation (grouped by their first own block hash), in arrival order."""
    groups: dict[int, list[int]] = {}
    for i, h in enumerate(t.prefix_hashes):
        if len(h) > 2:  # the other stream's requests have no hashes
            groups.setdefault(h[2], []).append(i)  # h[:2]: the system prompt's two whole blocks
    return list(groups.values())


def test_each_turn_of_a_conversation_starts_with_everything_before_it():
    t = scenario_trace(scenario(CONVERSATIONS))
    follow = [c for c in _by_conversation(t) if len(c) > 1]
    assert len(follow) > 10
    for c in follow:
        first = int(t.prompt_tokens[c[0]]) - 1100  # the first message; every message is as long
        for a, b in zip(c, c[1:]):
            assert t.arrival_s[b] > t.arrival_s[a] and t.tenant[b] == t.tenant[a]
            assert t.prompt_tokens[b] == t.prompt_tokens[a] + t.output_tokens[a] + first
            ha, hb = tuple(t.prefix_hashes[a]), tuple(t.prefix_hashes[b])
            assert hb[:len(ha)] == ha  # the earlier turn's blocks lead the later one's


def test_conversations_have_the_mean_number_of_turns_asked():
    from slicesched.replay.workload import _conversations
    from slicesched.traces import Trace

    n = 4000
    t = Trace.from_columns("t", np.zeros(n), np.full(n, 100), np.full(n, 10), ["a"] * n)
    out = _conversations(t, 0, 2.5, 1e-6, 1.0, 0, (0, 0))
    assert len(out) / n == pytest.approx(2.5, rel=0.05)


def test_conversation_rate_scales_are_prefix_nested():
    assert_prefix(scenario(CONVERSATIONS), 1.0, 2.5)
