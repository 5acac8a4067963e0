"""Turn a scenario's streams into one time-ordered, tenant-labelled request trace."""

from __future__ import annotations

import numpy as np

from slicesched.config.scenario import (DiurnalCurve, FlashCurve, Scenario, ServeGenStream, SyntheticStream,
                                        TraceStream)
from slicesched.errors import InputError
from slicesched.traces import Trace, list_servegen_clients, load_trace, servegen_trace, synthetic_trace
from slicesched.replay.replicas import BLOCK_TOKENS
from slicesched.serving import Request, key_prefixes
from slicesched.serving.prefix import MOONCAKE_HASH_BLOCK_TOKENS
from slicesched.traces.curves import Diurnal, FlashCrowd, Ramp, RateCurve, Steps


def scenario_trace(sc: Scenario, rate_scale: float = 1.0, duration_s: float | None = None) -> Trace:
    """The workload at rate scale k: `duration_s` seconds of arrivals after dividing the scenario's
    arrival times by `rate_scale`.

    One fixed sequence of requests per seed: streams are generated for `duration_s * rate_scale`
    seconds of their own time by prefix-consistent generators, with arrivals and lengths from
    independent random streams, so the requests at k1 < k2 are a prefix of those at k2 with
    identical lengths, and a request's lengths never depend on k or on the window.
    """
    duration = sc.replay.duration_s if duration_s is None else duration_s
    if any(s.curve for s in sc.streams):
        return _curved(sc, rate_scale, duration)
    span = duration * rate_scale
    parts = [_stream_trace(sc, i, s, span) for i, s in enumerate(sc.streams)]
    merged = parts[0].merge(*parts[1:], name=sc.name) if len(parts) > 1 else parts[0]
    return merged.scale_rate(rate_scale) if rate_scale != 1.0 else merged


def rate_curve(stream: SyntheticStream | TraceStream | ServeGenStream) -> RateCurve:
    """The stream's rate curve (see `traces.curves`)."""
    parts = []
    for c in stream.curve:
        if isinstance(c, DiurnalCurve):
            parts.append(Diurnal(c.period_s, c.amplitude, c.phase_s))
        elif isinstance(c, FlashCurve):
            parts.append(FlashCrowd(c.at_s, c.height, c.rise_s, c.decay_s))
        else:
            parts.append((Steps if c.kind == "steps" else Ramp)(c.times_s, c.multipliers))
    return RateCurve(tuple(parts))


def _curved(sc: Scenario, rate_scale: float, duration: float) -> Trace:
    """Each stream read for k M(D) of its own seconds, compressed by k, then time-warped by its
    curve (`RateCurve.warp`) and cut to the window: the rate at t is m(t) x k x its own."""
    parts = []
    for i, s in enumerate(sc.streams):
        curve = rate_curve(s)
        t = _stream_trace(sc, i, s, curve.cumulative(duration) * rate_scale)
        t = t.scale_rate(rate_scale) if rate_scale != 1.0 else t
        parts.append(t.time_warp(lambda own: curve.warp(own, duration)).window(0.0, duration))
    return parts[0].merge(*parts[1:], name=sc.name) if len(parts) > 1 else parts[0]


def _stream_trace(sc: Scenario, i: int, s, span: float) -> Trace:
    t = _stream_requests(sc, i, s, span)
    return t.with_max_tokens(s.max_tokens) if s.max_tokens else t


def _stream_requests(sc: Scenario, i: int, s, span: float) -> Trace:
    seed = (sc.seed, i)  # one seed sequence per stream; tenant labels draw from their own child
    if isinstance(s, SyntheticStream):
        t = synthetic_trace(span, s.rate, s.cv, prompt_mean=s.prompt_mean, prompt_sigma=s.prompt_sigma,
                            output_mean=s.output_mean, output_sigma=s.output_sigma, seed=seed, name=f"stream{i}")
        if s.turns_mean > 1:  # conversations keep their first turn's tenant: assigned before they unfold
            t = _assign(t, s.tenants, s.popularity, s.alpha, seed)
            return _conversations(t, s.system_prompt_tokens, s.turns_mean, s.think_s, span, i, seed)
        t = _with_system_prompt(t, s.system_prompt_tokens, i) if s.system_prompt_tokens else t
        return _assign(t, s.tenants, s.popularity, s.alpha, seed)
    if isinstance(s, TraceStream):
        t = load_trace(sc.resolve_path(s.path), s.format)
        if len(t) == 0:
            raise InputError("trace has no requests", file=str(sc.resolve_path(s.path)))
        if s.tick_s:
            t = t.spread_ticks(s.tick_s, (*seed, 3))
        t = t.window(s.start_s, s.start_s + span)
        return _assign(t, s.tenants, s.popularity, s.alpha, seed)
    if isinstance(s, ServeGenStream):
        return _servegen(sc, s, span, seed)
    raise AssertionError(f"unhandled stream type {type(s).__name__}")


def _with_system_prompt(t: Trace, tokens: int, stream: int) -> Trace:
    """Every prompt preceded by the stream's system prompt of `tokens` tokens, with prefix hashes
    (one per 512-token block, `MOONCAKE_HASH_BLOCK_TOKENS`): the system prompt's whole blocks
    share the stream's hashes, every other block is the request's own. Synthetic hashes are
    negative (traces publish non-negative ones) and distinct per stream."""
    block, base = MOONCAKE_HASH_BLOCK_TOKENS, -(stream + 1) * 10**12
    shared = tuple(base - b for b in range(tokens // block))
    prompts = t.prompt_tokens + tokens
    own = -(-prompts // block) - len(shared)  # the blocks after the shared ones
    first = np.cumsum(own) - own
    hashes = [shared + tuple(range(base - 10**9 - int(f), base - 10**9 - int(f) - int(n), -1))
              for f, n in zip(first, own)]
    return Trace.from_columns(t.name, t.arrival_s, prompts, t.output_tokens, t.tenant, hashes)


def _conversations(t: Trace, system: int, turns_mean: float, think_s: float, span: float, stream: int,
                   seed: tuple[int, int]) -> Trace:
    """Each request of `t` the first turn of a conversation of geometric(1 / turns_mean) turns
    (those arriving within `span`), `think_s` apart on average (exponential). A conversation is
    one token stream: the stream's system prompt, then per turn a message as long as the first
    prompt and the turn's output; turn j's prompt is that stream up to its message, so it starts
    with everything turn j - 1 saw and said. Prefix hashes name the stream's 512-token blocks:
    the system prompt's whole blocks are the stream's (as `_with_system_prompt` names them),
    every later block the conversation's own."""
    block, base = MOONCAKE_HASH_BLOCK_TOKENS, -(stream + 1) * 10**12
    shared = [base - b for b in range(system // block)]
    rows = []
    for c in range(len(t)):
        at, msg, out, tenant = float(t.arrival_s[c]), int(t.prompt_tokens[c]), int(t.output_tokens[c]), t.tenant[c]
        history, hashes = system, list(shared)
        rng = np.random.default_rng((*seed, 4, c))  # a conversation's own draws: a longer span keeps them
        for j in range(int(rng.geometric(1 / turns_mean))):
            at += rng.exponential(think_s) if j else 0.0
            if at >= span:
                break
            prompt = history + msg
            while len(hashes) * block < prompt:  # conversation c's block b: its own hash, whatever the span
                hashes.append(base - 10**9 - c * 10**5 - len(hashes))
            rows.append((at, prompt, out, tenant, tuple(hashes[:-(-prompt // block)])))
            history = prompt + out
    cols = list(zip(*rows)) if rows else [(), (), (), (), ()]
    return Trace.from_columns(t.name, np.array(cols[0], float), np.array(cols[1], np.int64),
                              np.array(cols[2], np.int64), list(cols[3]), list(cols[4]))


def _assign(t: Trace, tenants: tuple[str, ...], popularity: str, alpha: float, seed: tuple[int, int]) -> Trace:
    if len(tenants) == 1:
        return t.with_tenant(tenants[0])
    return t.assign_tenants(tenants, popularity, alpha, (*seed, 2))


CLIENT_CHOICE_S = 3600.0
"""ServeGen tenants default to the busiest clients over this long after the stream's start
(in trace time), a span fixed by the scenario alone so every rate scale and window sees the
same clients."""


def _servegen(sc: Scenario, s: ServeGenStream, span: float, seed: tuple[int, int]) -> Trace:
    """Client i feeds tenant i (default: the busiest clients of the hour after `start_s`).

    ServeGen rates are multiplied by `s.rate_scale`: reading rate_scale x the window and
    stretching it back, so the busiest production clients fit a test cluster.
    """
    root = sc.resolve_path(s.root)
    window = span * s.rate_scale
    clients = list(s.clients) if s.clients else [
        c.client for c in list_servegen_clients(root, s.category, s.model, s.start_s,
                                                CLIENT_CHOICE_S)[: len(s.tenants)]]
    t = servegen_trace(root, s.category, s.model, clients=clients, start_s=s.start_s, duration_s=window,
                       seed=sc.seed * 1000 + seed[1]).scale_rate(s.rate_scale)
    mapping = {f"{s.model}/{c}": name for c, name in zip(clients, s.tenants)}
    df = t.to_frame()
    df["tenant"] = df["tenant"].map(mapping)
    return Trace.from_frame(t.name, df)


def prompt_ids(seed: int, req: Request, vocab: int, block_tokens: int) -> tuple[int, ...]:
    """A replayed request's prompt token ids, for a backend that runs the model: each block its
    prefix keys name drawn from the key (so requests whose keys agree agree in their tokens, and
    a cached block holds the KV of the very tokens it names), the rest from the scenario's seed
    and the request's id."""
    block_ids = [np.random.default_rng((seed, k % 2**63)).integers(0, vocab, block_tokens) for k in req.prefix_keys]
    rest = np.random.default_rng((seed, req.id)).integers(0, vocab, req.prompt_tokens - len(block_ids) * block_tokens)
    return tuple(int(x) for x in np.concatenate([*block_ids, rest]))


def annotate(requests: list[Request], trace: Trace, prefix_caching: bool) -> None:
    """What a replay's requests take from their trace rows beyond lengths: prefix-cache keys
    (with prefix caching on, from the prefix hashes) and reasoning tokens."""
    if prefix_caching and trace.prefix_hashes is not None:
        key_prefixes(requests, trace.prefix_hashes, BLOCK_TOKENS)
    if trace.reason_tokens is not None:
        for r, n in zip(requests, trace.reason_tokens.tolist()):
            r.reason_tokens = n
