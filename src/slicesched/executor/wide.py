"""Wide stages: one stage of a tenant's model step run tensor-parallel over its home device and
devices lent to it, with real collectives between them.

SliceScheduler places an iteration of a leased replica whole on the union of home and borrowed
devices, or only its MLP slices there (`sched/slicesched.py`). The executor runs such a step
stage by stage on its home device's worker (rank 0); a stage placed on the union runs as `degree`
ranks, rank 0 at home (views of the full weights it holds) and rank r on a borrowed device (the
shard `ShardStage` copied there, `StagedShard`), each rank's partial sum all-reduced through the
union's process groups (`Communicators.groups`: gloo between the worker threads on CPU, NCCL
between distinct GPUs; made once per union and reused). Megatron cuts: q heads and MLP
intermediate columns split evenly, o_proj and down_proj row-parallel; a rank reads the KV heads
its q heads need (replicated when there are fewer KV heads than ranks). Norms are replicated.
The embedding and the head are replicated blocks: rank 0 computes them (what the other ranks
would compute is the same).

KV: the home pool holds every KV head. A borrowed device holds a *mirror* (`Mirror`) of its
rank's KV heads, slot for slot like the home pool, in memory its owner lent (the driver charges
it as the replica's KV grows). Before a wide attention the rank copies the slots it reads that
home wrote since (`synced` per layer and slot); after it, the KV it wrote for the new tokens is
copied home, so home-only stages after it, and every later step, read a complete pool. Bytes
moved both ways are counted.

A rank that cannot run its part (its shard missing, its memory budget refused, an error) votes
no before the all-reduce: no rank enters it, and rank 0 runs the stage alone at home, where all
the weights and KV are (`WideStats.fallbacks`): a lender's memory is never overrun and no
request is lost.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from slicesched.executor.moe import MoEWeights, is_moe, moe_copy, moe_part, moe_partial
from slicesched.executor.serving import AttentionWeights, PagedModel, StepState, attend

if TYPE_CHECKING:
    from slicesched.executor.remote_wide import RemoteShard
    from slicesched.executor.runtime import Executor

VOTE_TIMEOUT_S = 60.0


def q_heads_of(rank: int, degree: int, heads: int) -> range:
    if heads % degree:
        raise ValueError(f"{heads} attention heads do not split over {degree} devices")
    n = heads // degree
    return range(rank * n, (rank + 1) * n)


def kv_heads_of(q_heads: range, rep: int) -> range:
    """The KV heads q heads `q_heads` read (q head j reads KV head j // rep)."""
    return range(q_heads.start // rep, (q_heads.stop - 1) // rep + 1)


def rank_kv_heads(model: PagedModel, rank: int, degree: int) -> range:
    """The KV heads rank `rank` of `degree` reads (those of its q heads)."""
    return kv_heads_of(q_heads_of(rank, degree, model.heads), model.heads // model.kv_heads)


def cols_of(rank: int, degree: int, width: int) -> range:
    if width % degree:
        raise ValueError(f"an MLP {width} wide does not split over {degree} devices")
    n = width // degree
    return range(rank * n, (rank + 1) * n)


@dataclass(frozen=True, slots=True)
class MLPWeights:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor  # [hidden, cols]: the down_proj columns of these intermediate features


@dataclass(frozen=True, slots=True)
class ReplicaWeights:
    """A replicated block (embedding, head) held whole by every rank; rank 0 computes it."""

    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class StagedShard:
    """Rank `rank` of `degree` of one layer block (attention or MLP), resident on a device."""

    rank: int
    degree: int
    norm: torch.nn.Module
    weights: AttentionWeights | MLPWeights | MoEWeights | ReplicaWeights
    nbytes: int


def block_stage(model: PagedModel, block: int) -> int:
    """The `PagedModel` stage computing analytic weight block `block` (`gmg.builder`: attention
    and MLP of layer l are blocks 2l and 2l+1, the embedding 2L, the head 2L+1)."""
    layers = len(model.inner.layers)
    return 0 if block == 2 * layers else block if block == 2 * layers + 1 else block + 1


def rank_part(model: PagedModel, stage: int, rank: int, degree: int
          ) -> tuple[torch.nn.Module, AttentionWeights | MLPWeights | MoEWeights]:
    """Views of the full weights of `stage`, cut to rank `rank` of `degree` (no copy)."""
    layer = model.inner.layers[(stage - 1) // 2]
    if stage % 2:
        w = AttentionWeights.of(layer)
        qh = q_heads_of(rank, degree, model.heads)
        kh = kv_heads_of(qh, model.heads // model.kv_heads)
        d = model.head_dim

        def rows(t: torch.Tensor | None, r: range) -> torch.Tensor | None:
            return None if t is None else t.narrow(0, r.start * d, len(r) * d)

        return layer.input_layernorm, AttentionWeights(
            rows(w.q, qh), rows(w.k, kh), rows(w.v, kh), w.o.narrow(1, qh.start * d, len(qh) * d),
            rows(w.bq, qh), rows(w.bk, kh), rows(w.bv, kh), w.bo, w.q_norm, w.k_norm)
    mlp = layer.mlp
    if is_moe(mlp):
        return layer.post_attention_layernorm, moe_part(mlp, lambda width: cols_of(rank, degree, width))
    c = cols_of(rank, degree, mlp.gate_proj.weight.shape[0])
    return layer.post_attention_layernorm, MLPWeights(mlp.gate_proj.weight.narrow(0, c.start, len(c)),
                                                      mlp.up_proj.weight.narrow(0, c.start, len(c)),
                                                      mlp.down_proj.weight.narrow(1, c.start, len(c)))


def cut_shard(model: PagedModel, block: int, rank: int, degree: int, device: torch.device) -> StagedShard:
    """A real copy, on `device`, of rank `rank`'s shard of a layer block (what a `ShardStage` stages)."""
    stage = block_stage(model, block)

    def mv(t):
        return None if t is None else t.detach().to(device, copy=True).contiguous()

    if stage in (0, model.num_stages - 1):  # replicated: every rank holds all of it
        mods = [model.inner.embed_tokens] if stage == 0 else [model.inner.norm, model.model.lm_head]
        tensors = tuple(mv(p) for m in mods for p in m.parameters())
        return StagedShard(rank, degree, torch.nn.Identity(), ReplicaWeights(tensors),
                           sum(t.numel() * t.element_size() for t in tensors))
    norm, w = rank_part(model, stage, rank, degree)
    norm = copy.deepcopy(norm).to(device)
    if isinstance(w, AttentionWeights):
        qn = None if w.q_norm is None else copy.deepcopy(w.q_norm).to(device)
        kn = None if w.k_norm is None else copy.deepcopy(w.k_norm).to(device)
        w = AttentionWeights(mv(w.q), mv(w.k), mv(w.v), mv(w.o), mv(w.bq), mv(w.bk), mv(w.bv),
                             mv(w.bo) if rank == 0 else None, qn, kn)
    elif isinstance(w, MoEWeights):
        w = moe_copy(w, device)
    else:
        w = MLPWeights(mv(w.gate), mv(w.up), mv(w.down))
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(w)) + sum(
        p.numel() * p.element_size() for p in norm.parameters())
    return StagedShard(rank, degree, norm, w, nbytes)


def _tensors(w: AttentionWeights | MLPWeights | MoEWeights) -> list[torch.Tensor]:
    if isinstance(w, MoEWeights):
        return w.tensors()
    if isinstance(w, MLPWeights):
        return [w.gate, w.up, w.down]
    ts = [w.q, w.k, w.v, w.o, w.bq, w.bk, w.bv, w.bo]
    ts += [p for m in (w.q_norm, w.k_norm) if m is not None for p in m.parameters()]
    return [t for t in ts if t is not None]


@dataclass(slots=True)
class Mirror:
    """One rank's KV heads of a replica's pool on a borrowed device: per layer K and V
    [slots, heads, head_dim], and per layer which slots hold what home holds."""

    heads: range
    pool: list[tuple[torch.Tensor, torch.Tensor]]
    synced: list[torch.Tensor]  # per layer, bool [slots] (empty where home keeps them: device workers)

    @staticmethod
    def fits(m: "Mirror | None", heads: range, slots: int) -> bool:
        """Does `m` hold these KV heads of a pool of `slots` slots?"""
        return m is not None and m.heads == heads and m.pool[0][0].shape[0] == slots

    @classmethod
    def empty(cls, model: PagedModel, heads: range, slots: int, device: torch.device, synced: bool) -> "Mirror":
        """A mirror holding nothing yet, on `device` (`synced`: with its own per-slot marks)."""
        shape = (slots, len(heads), model.head_dim)
        layers = len(model.inner.layers)
        return cls(heads, [(torch.empty(shape, dtype=model.dtype, device=device),
                            torch.empty(shape, dtype=model.dtype, device=device)) for _ in range(layers)],
                   [torch.zeros(slots, dtype=torch.bool) for _ in range(layers)] if synced else [])


@dataclass(slots=True)
class WideStats:
    """What wide stages did: counted by the backend, read by reports and tests."""

    stages: int = 0
    fallbacks: int = 0  # wide stages a rank refused, run at home instead
    kv_to_mirror_bytes: float = 0.0
    kv_home_bytes: float = 0.0
    activation_bytes: float = 0.0


class _Vote:
    """Whether every rank can run its part (threads of one process: a condition, not a collective)."""

    def __init__(self, n: int) -> None:
        self.n, self.ballots, self.nays = n, 0, 0
        self.cv = threading.Condition()

    def cast(self, ok: bool) -> bool:
        with self.cv:
            self.ballots += 1
            self.nays += not ok
            self.cv.notify_all()
            all_in = self.cv.wait_for(lambda: self.ballots == self.n, VOTE_TIMEOUT_S)
            return all_in and self.nays == 0


@dataclass(slots=True)
class WideContext:
    """What a wide stage needs from the backend: the executor, the borrowed devices' shards and
    mirrors (owned by the backend, keyed by (tenant, device)), and the counters."""

    executor: "Executor"
    shards: dict[tuple[str, int], dict[int, "StagedShard | RemoteShard"]]  # remote: staged on a device worker
    mirrors: dict[tuple[tuple, int], Mirror]  # (pool key, device) -> mirror
    stats: WideStats = field(default_factory=WideStats)
    lock: threading.Lock = field(default_factory=threading.Lock)


def rank_order(ctx: WideContext, tenant: str, home: int, devices: tuple[int, ...]) -> tuple[int, ...] | None:
    """The union's devices in rank order (home first, each borrowed device at the rank of the
    shards staged on it), or None when a borrowed device holds none of the tenant's shards."""
    ranks = {home: 0}
    for d in devices:
        if d == home:
            continue
        shards = ctx.shards.get((tenant, d))
        if not shards:
            return None
        ranks[d] = next(iter(shards.values())).rank
    order = tuple(sorted(ranks, key=ranks.__getitem__))
    return order if sorted(ranks.values()) == list(range(len(devices))) else None


def run_wide_stage(ctx: WideContext, model: PagedModel, tenant: str, i: int, st: StepState,
                   order: tuple[int, ...]) -> bool:
    """Stage i of a step over the devices `order` (rank order; rank 0 is the caller's, home).
    False when some rank refused: nothing was computed, the caller runs the stage at home."""
    ex, degree = ctx.executor, len(order)
    block = i - 1
    pgs = ex.collectives.groups(order, [ex.devices[d].torch_device for d in order])
    vote = _Vote(degree)
    results: list[BaseException | None] = [None] * degree
    finished = [threading.Event() for _ in order[1:]]
    for r, d in enumerate(order[1:], 1):
        ex.devices[d].submit(_rank_job(ctx, model, tenant, i, block, st, r, d, pgs[r], vote, results, finished[r - 1]))
    norm, w = rank_part(model, i, 0, degree)
    ok = vote.cast(True)
    if ok:
        partial = rank_partial(model, i, norm, w, st, st.pool[(i - 1) // 2] if i % 2 else None, 0, degree, st.new)
        y = partial.clone()
        pgs[0].allreduce([y]).wait()
    for e in finished:
        e.wait()
    err = next((e for e in results if e is not None), None)
    if err is not None:
        raise RuntimeError(f"a rank of a wide stage of {tenant!r} failed: {err}") from err
    if not ok:
        with ctx.lock:
            ctx.stats.fallbacks += 1
        return False
    st.h = st.h + y
    with ctx.lock:
        ctx.stats.stages += 1
    return True


def _rank_job(ctx: WideContext, model: PagedModel, tenant: str, i: int, block: int, st: StepState, rank: int,
              device: int, pg, vote: _Vote, results: list, finished: threading.Event):
    def job() -> None:
        dev = ctx.executor.devices[device]
        voted = False
        act = float(st.h.numel() * st.h.element_size() * 3)  # its copy of the hidden state, its partial sum, the sum
        reserved = False
        try:
            shard = ctx.shards.get((tenant, device), {}).get(block)
            can = shard is not None and shard.rank == rank and shard.degree == len(results)
            if can:
                reserved = dev.reserve(act, "activation", tenant) is None
                can = reserved
            voted = True
            if not vote.cast(can):
                return
            with torch.inference_mode():
                moved = _to_rank(st, dev.torch_device)
                mirror = _mirror(ctx, model, st, rank, len(results), device) if i % 2 else None
                if mirror is not None:
                    _sync_mirror(ctx, st, mirror, (i - 1) // 2, moved)
                kv = None if mirror is None else mirror.pool[(i - 1) // 2]
                partial = rank_partial(model, i, shard.norm, shard.weights, moved, kv, rank, len(results), moved.new)
                pg.allreduce([partial]).wait()
                if mirror is not None:
                    _copy_home(ctx, st, mirror, (i - 1) // 2, moved.new)
                if dev.cuda:
                    torch.cuda.current_stream(dev.torch_device).synchronize()
        except BaseException as e:  # reported by rank 0, in its thread
            results[rank] = e
            if not voted:
                vote.cast(False)
        finally:
            if reserved:
                dev.release(act)
            finished.set()

    return job


def rank_partial(model: PagedModel, i: int, norm: torch.nn.Module, w: AttentionWeights | MLPWeights | MoEWeights,
             st: StepState,
             kv: tuple[torch.Tensor, torch.Tensor] | None, rank: int, degree: int, new: torch.Tensor) -> torch.Tensor:
    """Rank `rank`'s partial sum of stage i (attention into `kv`, the rank's pool or mirror)."""
    x = norm(st.h)
    if isinstance(w, MoEWeights):
        return moe_partial(w, x)
    if isinstance(w, MLPWeights):
        act = model.inner.layers[(i - 1) // 2].mlp.act_fn
        f = torch.nn.functional.linear
        return f(act(f(x, w.gate)) * f(x, w.up), w.down)
    qh = q_heads_of(rank, degree, model.heads)
    rep = model.heads // model.kv_heads
    a = model.inner.layers[(i - 1) // 2].self_attn
    if rank == 0:  # home's pool holds every KV head: this rank's are a view of it
        kh = kv_heads_of(qh, rep)
        kv = (kv[0].narrow(1, kh.start, len(kh)), kv[1].narrow(1, kh.start, len(kh)))
    return attend(w, x, st.cos, st.sin, kv, new, st.layout, qh, rep, model.head_dim, a.scaling)


def _to_rank(st: StepState, device: torch.device) -> StepState:
    """The step's hidden state and metadata, copied to a rank's device (a real copy on every
    device: what moves over the fabric)."""
    def mv(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, copy=True)

    return StepState(st.key, st.pool, st.layout.to(device), mv(st.new),
                     mv(st.cos), mv(st.sin), mv(st.h))


def _mirror(ctx: WideContext, model: PagedModel, st: StepState, rank: int, degree: int, device: int) -> Mirror:
    key = (st.key, device)
    heads = rank_kv_heads(model, rank, degree)
    m = ctx.mirrors.get(key)
    slots = st.pool[0][0].shape[0]
    if not Mirror.fits(m, heads, slots):
        m = ctx.mirrors[key] = Mirror.empty(model, heads, slots, ctx.executor.devices[device].torch_device, True)
    assert m is not None
    return m


def mark_written(ctx: WideContext, key: tuple, layer: int, slots: torch.Tensor) -> None:
    """Home wrote these slots of layer `layer` of pool `key`: every mirror of it lacks them."""
    for (k, _d), m in list(ctx.mirrors.items()):
        if k == key:
            m.synced[layer][slots.cpu()] = False


def _sync_mirror(ctx: WideContext, st: StepState, m: Mirror, layer: int, moved: StepState) -> None:
    """Copy the slots this stage reads that the mirror lacks, from home's pool."""
    read = st.layout.read
    stale = read[~m.synced[layer][read]]
    if not len(stale):
        return
    hk, hv = st.pool[layer]
    mk, mv = m.pool[layer]
    src = stale.to(hk.device)
    dst = stale.to(mk.device)
    h = m.heads
    mk[dst] = hk[src, h.start:h.stop].to(mk.device)
    mv[dst] = hv[src, h.start:h.stop].to(mv.device)
    m.synced[layer][stale] = True
    with ctx.lock:
        ctx.stats.kv_to_mirror_bytes += 2 * len(stale) * len(h) * mk.shape[-1] * mk.element_size()


def _copy_home(ctx: WideContext, st: StepState, m: Mirror, layer: int, new: torch.Tensor) -> None:
    """The KV this rank wrote for the new tokens, copied into home's pool (its heads)."""
    hk, hv = st.pool[layer]
    mk, mv = m.pool[layer]
    h = m.heads
    dst = new.to(hk.device)
    hk[dst, h.start:h.stop] = mk[new].to(hk.device)
    hv[dst, h.start:h.stop] = mv[new].to(hv.device)
    m.synced[layer][new.cpu()] = True
    with ctx.lock:
        ctx.stats.kv_home_bytes += 2 * len(new) * len(h) * mk.shape[-1] * mk.element_size()
