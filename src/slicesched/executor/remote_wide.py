"""Wide steps across device worker processes: a step's stages tensor-parallel over its home
worker and the workers of devices lent to it, with gloo collectives between the processes.

The protocol of one wide step (`remote.py`'s workers, driven by `steps.py`): the driver hands the
home worker `run_wide` and each lender `join_wide`, with the step's inputs and the same plan
(the union's devices in rank order, the model stages to run over it). Every rank computes the
step's frame (attention layout, new slots, rotary cos and sin) from the inputs itself; what
crosses between the processes is:

- one vote at the step's start (an all-reduce of refusals): a lender missing a shard, or whose
  driver found its memory budget full, votes no and the home runs every stage alone;
- the hidden state, broadcast from home before a wide stage that follows a home-only one (after
  a wide stage every rank already holds the same sum);
- for an attention stage, the KV slots the batch reads that the lender's mirror lacks (home to
  lender, its KV heads only), then the KV the lender wrote for the new tokens (lender to home):
  point to point, through host memory (gloo sends only CPU tensors);
- each rank's partial sum, all-reduced.

Mirrors: a lender keeps, per replica pool, a mirror of its rank's KV heads (`wide.Mirror`'s
layout). Home keeps what each lender's mirror holds (per layer and slot: in sync or not), marks
slots stale when it writes them itself (a home-only stage, a step run at home, KV moved in) and
in sync when it sends them or receives them back, so a slot crosses once per write. A wide step
with attention stages opens with a handshake: home sends its pool's size, each lender makes its
mirror that size if it is not and answers with the mirror's identity (its process and a
counter); an identity home has not seen (a mirror made anew: a restarted process, a resized
pool, shards staged again) makes home take that mirror as empty.

Shards: a lender cuts its shards from the tenant's whole model built in its own process's host
memory from the recipe (`ModelRecipe`: its seed or checkpoint), kept while any of its shards is
staged there; only the shards go to its device.
Process groups connect through a TCP store the driver's `DeviceWorkers` hosts on loopback: the
workers of one host (a local Ray cluster) make wide steps; a union over hosts would not connect.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from slicesched.decisions import StepInputs
from slicesched.executor.collectives import make_group
from slicesched.executor.serving import PagedModel, StepState, slots_of
from slicesched.executor.wide import Mirror, StagedShard, cut_shard, rank_kv_heads, rank_part, rank_partial

_SLOTS, _MIRROR, _STALE, _IDX, _KV, _KV_HOME = range(6)  # gloo tags of the messages
_mirror_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class WidePlan:
    """One step's wide stages: the union's devices in rank order (home first) and the stages."""

    order: tuple[int, ...]
    stages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RemoteShard:
    """A shard staged on a lender's worker, as the driver knows it (its weights live there)."""

    rank: int
    degree: int
    nbytes: float


@dataclass(slots=True)
class WideWork:
    """What one rank's part of a wide step did (summed into the driver's `WideStats`)."""

    ran: bool = False  # every rank voted yes: the plan's stages ran wide
    kv_to_mirror_bytes: float = 0.0
    kv_home_bytes: float = 0.0


@dataclass(slots=True)
class WorkerWide:
    """One worker's part in wide steps: as a lender, its staged shards, the whole models they
    were cut from, and its mirrors; as a home, what each lender's mirror holds; its process groups."""

    torch_device: str
    shards: dict[str, dict[int, StagedShard]] = field(default_factory=dict)  # tenant -> block -> shard
    whole: dict[str, PagedModel] = field(default_factory=dict)  # tenant -> model its shards were cut from
    mirrors: dict[tuple, Mirror] = field(default_factory=dict)  # pool key -> this lender's mirror
    mirror_ids: dict[tuple, int] = field(default_factory=dict)  # pool key -> this lender's mirror's identity
    synced: dict[tuple[tuple, int], list[torch.Tensor]] = field(default_factory=dict)  # (pool, lender) -> per layer
    seen: dict[tuple[tuple, int], int] = field(default_factory=dict)  # (pool, lender) -> the mirror `synced` is of
    groups: dict[tuple[int, ...], dist.Backend] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- set-up ---------------------------------------------------------------------------
    def connect(self, order: tuple[int, ...], rank: int, name: str, host: str, port: int) -> None:
        """Join the union's process group `name` (every rank calls this at once; blocks until
        all have), replacing any earlier group of the same devices."""
        store = dist.PrefixStore(name + "/", dist.TCPStore(host, port, is_master=False))
        pg = make_group(store, rank, len(order), [torch.device(self.torch_device)] * len(order))
        with self.lock:
            self.groups[order] = pg

    def stage(self, tenant: str, build, block: int, rank: int, degree: int) -> float:
        """Cut rank `rank` of `degree`'s shard of `block` here (`build()`: the tenant's whole
        model in this process, made once); returns its bytes."""
        with self.lock:
            whole = self.whole.get(tenant)
        if whole is None:
            whole = PagedModel(build())
        with torch.inference_mode():
            shard = cut_shard(whole, block, rank, degree, torch.device(self.torch_device))
        with self.lock:
            self.whole.setdefault(tenant, whole)
            self.shards.setdefault(tenant, {})[block] = shard
        return float(shard.nbytes)

    def release(self, tenant: str, block: int) -> None:
        """Drop a shard; with the tenant's last one go its whole model and its mirrors here."""
        with self.lock:
            held = self.shards.get(tenant, {})
            held.pop(block, None)
            if not held:
                self.shards.pop(tenant, None)
                self.whole.pop(tenant, None)
                for key in [k for k in self.mirrors if k[0] == tenant]:
                    del self.mirrors[key], self.mirror_ids[key]

    def written(self, pool: tuple, inputs: StepInputs | None = None, slots: torch.Tensor | None = None,
                layer: int | None = None) -> None:
        """As a home: these slots of `pool` (the new tokens of `inputs`, or `slots`) were written
        here, in layer `layer` or all: every lender's mirror lacks them."""
        with self.lock:
            marks = [m for (k, _), m in self.synced.items() if k == pool]
        if not marks:
            return
        if slots is None:
            assert inputs is not None
            slots = torch.cat([slots_of(t, c + len(f), inputs.block_tokens)[c:] for t, c, f in
                               zip(inputs.block_tables, inputs.context_lens_before, inputs.token_ids)])
        with torch.inference_mode():  # the marks are made in a step, as inference tensors
            for per_layer in marks:
                for m in (per_layer if layer is None else per_layer[layer:layer + 1]):
                    m[slots] = False

    # ---- a wide step ----------------------------------------------------------------------
    def run_home(self, model: PagedModel, inputs: StepInputs, plan: WidePlan, clock
                 ) -> tuple[tuple[int, ...], list[float], WideWork]:
        """Rank 0's step: every stage, the plan's over the union if all ranks agree. Returns each
        entry's token, each stage's end (`clock()`) and what it did."""
        pg, work, ends = self.groups[plan.order], WideWork(), []
        wide = set(plan.stages)
        with torch.inference_mode():
            st = model.prepare(inputs)
            ends.append(clock())
            work.ran = _vote(pg, True)
            if work.ran and any(i % 2 for i in wide):
                self._handshake_home(pg, plan, st)
            fresh = False  # do the lenders hold st.h as it is now?
            for i in range(1, model.num_stages - 1):
                layer = (i - 1) // 2
                if work.ran and i in wide:
                    if not fresh:
                        pg.broadcast(st.h, 0).wait()
                    if i % 2:
                        self._send_kv(pg, model, plan, st, layer, work)
                    norm, w = rank_part(model, i, 0, len(plan.order))
                    y = rank_partial(model, i, norm, w, st, st.pool[layer] if i % 2 else None, 0, len(plan.order),
                                     st.new)
                    pg.allreduce([y]).wait()
                    if i % 2:
                        self._take_kv(pg, model, plan, st, layer, work)
                    st.h, fresh = st.h + y, True
                else:
                    model.stage(i, st)
                    fresh = False
                    if i % 2:
                        self.written(st.key, slots=st.new.cpu(), layer=layer)
                ends.append(clock())
            out = model.finish(st)
        ends.append(clock())
        return out, ends, work

    def run_lender(self, tenant: str, inputs: StepInputs, plan: WidePlan, rank: int, can: bool) -> WideWork:
        """Rank `rank`'s part of a wide step (`can`: its driver found room for its activations)."""
        pg, work, degree = self.groups[plan.order], WideWork(), len(plan.order)
        with self.lock:
            held, whole = dict(self.shards.get(tenant, {})), self.whole.get(tenant)
        ok = can and whole is not None and all(
            (s := held.get(i - 1)) is not None and s.rank == rank and s.degree == degree for i in plan.stages)
        work.ran = _vote(pg, ok)
        if not work.ran:
            return work
        assert whole is not None
        dev = torch.device(self.torch_device)
        with torch.inference_mode():
            tokens = sum(len(f) for f in inputs.token_ids)
            h = torch.empty(1, tokens, whole.model.config.hidden_size, dtype=whole.dtype, device=whole.device)
            layout, new, cos, sin = whole.frame(inputs, h)  # on the whole model's device (host memory)
            st = StepState(inputs.pool, [], layout, new, cos, sin, h)
            if dev != whole.device:
                st = StepState(inputs.pool, [], layout.to(dev), new.to(dev), cos.to(dev), sin.to(dev), h.to(dev))
            mirror = self._handshake_lender(pg, whole, inputs.pool, rank, degree) if any(
                i % 2 for i in plan.stages) else None
            before = -1
            for i in sorted(plan.stages):
                if before != i - 1:
                    pg.broadcast(st.h, 0).wait()
                shard = held[i - 1]
                kv = None
                if i % 2:
                    assert mirror is not None
                    self._take_stale(pg, mirror, (i - 1) // 2, dev)
                    kv = mirror.pool[(i - 1) // 2]
                y = rank_partial(whole, i, shard.norm, shard.weights, st, kv, rank, degree, st.new)
                pg.allreduce([y]).wait()
                if i % 2:
                    k, v = kv
                    pg.send([torch.stack([k[st.new], v[st.new]]).cpu()], 0, _KV_HOME).wait()
                    work.kv_home_bytes += 2 * k[st.new].numel() * k.element_size()
                st.h, before = st.h + y, i
        return work

    # ---- KV between home and mirrors ------------------------------------------------------
    def _marks(self, pool: tuple, lender: int, layers: int, slots: int) -> list[torch.Tensor]:
        with self.lock:
            m = self.synced.get((pool, lender))
            if m is None or m[0].shape[0] != slots:  # a new (or resized) pool: the mirror holds nothing of it
                m = self.synced[(pool, lender)] = [torch.zeros(slots, dtype=torch.bool) for _ in range(layers)]
            return m

    def _send_kv(self, pg, model: PagedModel, plan: WidePlan, st: StepState, layer: int, work: WideWork) -> None:
        """To each lender, the slots this attention reads that its mirror lacks (its KV heads)."""
        hk, hv = st.pool[layer]
        read = st.layout.read
        for rank, lender in enumerate(plan.order[1:], 1):
            heads = rank_kv_heads(model, rank, len(plan.order))
            marks = self._marks(st.key, lender, len(st.pool), hk.shape[0])
            stale = read[~marks[layer][read]].unique()
            pg.send([torch.tensor([len(stale)])], rank, _STALE).wait()
            if len(stale):
                at = stale.to(hk.device)
                pg.send([stale.clone()], rank, _IDX).wait()
                pg.send([torch.stack([hk[at, heads.start:heads.stop], hv[at, heads.start:heads.stop]]).cpu()],
                        rank, _KV).wait()
                marks[layer][stale] = True
                work.kv_to_mirror_bytes += 2 * len(stale) * len(heads) * hk.shape[-1] * hk.element_size()

    def _take_kv(self, pg, model: PagedModel, plan: WidePlan, st: StepState, layer: int, work: WideWork) -> None:
        """From each lender, the KV its heads wrote for the new tokens, into home's pool."""
        hk, hv = st.pool[layer]
        new = st.new
        for rank, lender in enumerate(plan.order[1:], 1):
            heads = rank_kv_heads(model, rank, len(plan.order))
            kv = torch.empty(2, len(new), len(heads), hk.shape[-1], dtype=hk.dtype)
            pg.recv([kv], rank, _KV_HOME).wait()
            kv = kv.to(hk.device)
            hk[new, heads.start:heads.stop] = kv[0]
            hv[new, heads.start:heads.stop] = kv[1]
            self._marks(st.key, lender, len(st.pool), hk.shape[0])[layer][new.cpu()] = True

    def _handshake_home(self, pg, plan: WidePlan, st: StepState) -> None:
        """Home's side: its pool's size to each lender; a mirror identity not seen before, its marks anew."""
        slots = st.pool[0][0].shape[0]
        for rank, lender in enumerate(plan.order[1:], 1):
            pg.send([torch.tensor([slots])], rank, _SLOTS).wait()
            ident = torch.zeros(1, dtype=torch.long)
            pg.recv([ident], rank, _MIRROR).wait()
            with self.lock:
                if self.seen.get((st.key, lender)) != int(ident[0]):
                    self.seen[(st.key, lender)] = int(ident[0])
                    self.synced.pop((st.key, lender), None)  # `_marks` makes them anew: nothing held

    def _handshake_lender(self, pg, whole: PagedModel, pool: tuple, rank: int, degree: int) -> Mirror:
        """A lender's side: its mirror of `pool`, made anew at home's size if it is not that size
        (or holds other heads), its identity sent home."""
        size = torch.zeros(1, dtype=torch.long)
        pg.recv([size], 0, _SLOTS).wait()
        slots, heads = int(size[0]), rank_kv_heads(whole, rank, degree)
        with self.lock:
            m = self.mirrors.get(pool)
            if not Mirror.fits(m, heads, slots):  # home keeps the marks of what it holds
                m = self.mirrors[pool] = Mirror.empty(whole, heads, slots, torch.device(self.torch_device), False)
                self.mirror_ids[pool] = os.getpid() * 1_000_000 + next(_mirror_ids)
            ident = self.mirror_ids[pool]
        pg.send([torch.tensor([ident])], 0, _MIRROR).wait()
        return m

    def _take_stale(self, pg, m: Mirror, layer: int, dev: torch.device) -> None:
        """A lender's side: the slots home sent for this layer, into the mirror."""
        n = torch.zeros(1, dtype=torch.long)
        pg.recv([n], 0, _STALE).wait()
        stale = int(n[0])
        if not stale:
            return
        mk, mv = m.pool[layer]
        idx = torch.empty(stale, dtype=torch.long)
        kv = torch.empty(2, stale, *mk.shape[1:], dtype=mk.dtype)
        pg.recv([idx], 0, _IDX).wait()
        pg.recv([kv], 0, _KV).wait()
        kv, at = kv.to(dev), idx.to(dev)
        mk[at] = kv[0]
        mv[at] = kv[1]


def _vote(pg, ok: bool) -> bool:
    """True when every rank of the group says yes (an all-reduce of the refusals)."""
    nays = torch.tensor([0 if ok else 1])
    pg.allreduce([nays]).wait()
    return int(nays[0]) == 0
