"""Calibrating the simulator on what served model steps really cost here.

    prof = calibrate_serving(models, factories, executor, devices)   # a cost.Profile
    cost = CalibratedCostModel(prof)                                 # prices served models by it

A profile of single ops (`executor/profiler.py`) misses most of what a served step spends on a
CPU device: each module's Python, the per-request attention loop and the batch's slot tables,
the hand-over to the device worker and the stage events back. This calibration runs the served
models' real steps (`PagedModel` through `ExecutorBackend`, as the replay driver does) over a
grid of batch shapes and records, per step, every stage's seconds (the embedding with the
batch's preparation, each layer's attention and MLP, the head) and the seconds per slice spent
outside them: from building the step's graph until it is retired, the executor's and the
backend's part (hand-over, stage events, GMG updates). It is a step of its own, never the run
it helps predict. Stage rows are `stage_<name>` and overheads `dispatch` (`cost/stages.py`).

Times are wall-clock means over repeats taken in rounds of shuffled order, so that a burst of
machine noise hits all shapes alike: wall time, because serving is judged on the wall clock, and
means, not medians, because a request's latency is a sum of step times, the steps slowed by
other processes preempting this one included (on a shared machine they are many).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from slicesched.cost.profile import Profile
from slicesched.cost.stages import DISPATCH, STAGES, batch_features, block_stage, graph_block_weights
from slicesched.decisions import SchedulerDecision, SlicePlacement, StepInputs, WeightCopy
from slicesched.executor.backend import ExecutorBackend
from slicesched.executor.remote import DeviceWorkers
from slicesched.executor.runtime import Executor
from slicesched.executor.serving import PagedModel
from slicesched.gmg import GlobalMappingGraph
from slicesched.gmg.builder import build_iteration
from slicesched.gmg.ops import BatchShape, Grain, IterationGraph
from slicesched.hardware import Cluster, Container
from slicesched.models.spec import ModelSpec

BLOCK_TOKENS = 16  # the replay driver's KV block size


@dataclass(frozen=True, slots=True)
class StepShape:
    """One batch: per sequence, the tokens it feeds and the tokens already cached before them."""

    new: tuple[int, ...]
    context: tuple[int, ...]

    @classmethod
    def of(cls, *seqs: tuple[int, int]) -> "StepShape":
        return cls(tuple(n for n, _ in seqs), tuple(c for _, c in seqs))


def _grid() -> tuple[StepShape, ...]:
    """Decode batches by context, prefill chunks by context, and chunks riding with decodes (as
    chunked prefill batches them): the shapes a served CPU tenant's steps take."""
    decodes = [StepShape.of(*[(1, c)] * b) for b in (1, 2, 4, 8, 16, 32) for c in (32, 128, 384)]
    prefills = [StepShape.of((n, c)) for n in (16, 64, 128) for c in (0, 128)] + [StepShape.of((64, 0), (64, 0))]
    mixed = [StepShape.of((64, 0), *[(1, 128)] * 4), StepShape.of((32, 0), *[(1, 64)] * 8),
             StepShape.of((96, 0), (1, 200), (1, 200))]
    return (*decodes, *prefills, *mixed)


GRID = _grid()


@dataclass(frozen=True, slots=True)
class _Job:
    """One calibration step of a tenant: its shape, where it runs and the pool blocks it owns."""

    tenant: str
    device: int
    shape: StepShape
    tables: tuple[tuple[int, ...], ...]
    feed: tuple[tuple[int, ...], ...]
    warm: tuple[tuple[int, ...], ...]  # the context each sequence holds before it (written once)
    lender: int = -1  # >= 0: the step runs tensor-parallel over its device and this one (a wide step)


def _jobs(models: Mapping[str, ModelSpec], devices: Mapping[str, int], grid: Sequence[StepShape],
          seed: int, lenders: Mapping[str, int]) -> tuple[list[_Job], int]:
    """Every (tenant, shape) with disjoint KV blocks, at home and, for a tenant with a lender,
    over home and lender; the pool size they need."""
    rng = np.random.default_rng(seed)
    jobs, next_block = [], 0
    for tenant, spec in models.items():
        for s, lender in [(s, -1) for s in grid] + [(s, lenders[tenant]) for s in grid if tenant in lenders]:
            tables = []
            for n, c in zip(s.new, s.context):
                need = -(-(n + c) // BLOCK_TOKENS)
                tables.append(tuple(range(next_block, next_block + need)))
                next_block += need
            ids = [tuple(int(x) for x in rng.integers(0, spec.vocab, n + c)) for n, c in zip(s.new, s.context)]
            jobs.append(_Job(tenant, devices[tenant], s, tuple(tables), tuple(i[c:] for i, c in zip(ids, s.context)),
                             tuple(i[:c] for i, c in zip(ids, s.context)), lender))
    return jobs, next_block


def _inputs(job: _Job, num_blocks: int, warm: bool = False) -> StepInputs:
    if warm:  # the context, fed as one prefill of every sequence that has one
        keep = [i for i, c in enumerate(job.shape.context) if c]
        return StepInputs(("calibration", job.device), num_blocks, BLOCK_TOKENS, tuple(job.warm[i] for i in keep),
                          (0,) * len(keep), tuple(job.tables[i] for i in keep))
    return StepInputs(("calibration", job.device), num_blocks, BLOCK_TOKENS, job.feed, job.shape.context, job.tables)


def _run(backend: ExecutorBackend, models: Mapping[str, ModelSpec], steps: Sequence[tuple[_Job, StepInputs]]
         ) -> list[tuple[IterationGraph, np.ndarray, float]]:
    """Steps as the replay driver runs them (their graphs built, added, each placed whole on its
    job's device, executed until finished, retired), all at once. Per step: its graph, every
    stage's seconds and the seconds per slice outside the stages."""
    t0, handles, graphs = backend.executor.clock(), [], []
    for job, inputs in steps:
        new = np.array([len(f) for f in inputs.token_ids], np.int64)
        shape = BatchShape(new, np.array(inputs.context_lens_before, np.int64), len(new))
        tp = 1 if job.lender < 0 else 2
        graphs.append(build_iteration(models[job.tenant], shape, tp, Grain.BLOCK, job.tenant, 0))
        handles.append(backend.add_iteration(graphs[-1], home=backend.gmg.cluster.group_id((job.device,)),
                                             inputs=inputs))
    cluster = backend.gmg.cluster
    place = tuple(SlicePlacement(h.slice_base, cluster.group_id((j.device,) if j.lender < 0 else (j.device, j.lender)),
                                 h.num_slices) for h, (j, _) in zip(handles, steps))
    ends, turn, run = {}, {}, {}
    out = backend.execute(SchedulerDecision(backend.now, place), wake="iteration")
    while True:
        ends.update({c.slice_id: c.end for c in out.completed})
        done = [key for key, _ in out.tokens]  # the order the backend appended their runs
        for key, r in zip(done, backend.runs[len(backend.runs) - len(done):]):
            backend.retire(key)
            turn[key], run[key] = backend.executor.clock() - t0, r
        if len(turn) == len(handles):
            break
        out = backend.execute(SchedulerDecision(backend.now), wake="iteration")
    res = []
    for h, g in zip(handles, graphs):
        if g.num_slices != len(graph_block_weights(g)):
            raise ValueError("calibration needs one slice per model stage (block grain)")
        e = np.array([ends[h.slice_base + i] for i in range(g.num_slices)])
        start, seconds = run[h.key]
        res.append((g, np.diff(e, prepend=start), (turn[h.key] - seconds) / g.num_slices))
    return res


def _stage_lenders(backend: ExecutorBackend, models: Mapping[str, ModelSpec], devices: Mapping[str, int]
                   ) -> dict[str, int]:
    """Stage each tenant's TP-2 shards on the next device (its lender in wide steps) and wait for
    them to land; tenants whose heads do not split in two get none."""
    n = backend.executor.num_devices
    if n < 2:
        return {}
    lenders = {}
    for tenant, d in devices.items():
        backend.served.model(tenant, d)  # resident at home before its shards are cut
        if models[tenant].heads % 2 or models[tenant].intermediate % 2:
            continue
        lenders[tenant] = (d + 1) % n
        copies = tuple(WeightCopy(tenant, b, d, lenders[tenant], 0.0, 1, 2) for b in range(2 * models[tenant].layers + 2))
        backend.apply(SchedulerDecision(backend.now, weight_copies=copies))
    gmg = backend.gmg
    while not all(gmg.weights_on(t, 0, 2 * models[t].layers + 1, (dev,)) for t, dev in lenders.items()):
        backend.execute(SchedulerDecision(backend.now), until=backend.now + 0.05)
    return lenders


def _rows(graph: IterationGraph, stages: np.ndarray, dispatch: np.ndarray, device: str) -> list[dict]:
    """Profile rows of one (tenant, shape): each stage's mean seconds and the dispatch's."""
    feats = batch_features(graph)
    wb = graph_block_weights(graph)
    kind = block_stage(np.arange(len(wb)))
    # the model's stages run embedding, (attention, MLP) per layer, head; blocks are numbered
    # attention 2l, MLP 2l+1, embedding 2L, head 2L+1
    order = np.concatenate([[len(wb) - 2], np.arange(len(wb) - 2), [len(wb) - 1]])
    med, spread = np.mean(stages, 0), np.std(stages, 0)
    base = {"device": device, "model": graph.model, "rows": feats["tokens"], "seqs": feats["seqs"],
            **{f: feats[f] for f in ("tokens", "keys", "kv", "logits")}}
    rows = [{**base, "kind": f"stage_{STAGES[kind[b]]}", "weight_bytes": float(wb[b]), "time_s": float(med[i]),
             "time_std_s": float(spread[i])} for i, b in enumerate(order)]
    rows.append({**base, "kind": DISPATCH, "time_s": float(np.mean(dispatch)), "time_std_s": float(np.std(dispatch))})
    return rows


def _rounds(jobs: Sequence[_Job], repeats: int, together: int, rng: np.random.Generator) -> list[list[int]]:
    """Which jobs run at once, round after round: one at a time (`together` 0 or 1), or one job
    of each of `together` devices at once (the devices taking turns), each device's jobs in a
    new shuffled order every repeat. A wide job (two devices' threads) shares its round with
    home jobs of `together` - 2 other devices: two wide steps whose homes lend to each other
    would wait on each other's devices (SliceScheduler never lends a borrower's devices)."""
    if together <= 1:
        return [[int(i)] for _ in range(repeats) for i in rng.permutation(len(jobs))]
    per_device: dict[int, list[int]] = {}
    wide = [i for i, j in enumerate(jobs) if j.lender >= 0]
    for i, j in enumerate(jobs):
        if j.lender < 0:
            per_device.setdefault(j.device, []).append(i)
    devices = sorted(per_device)
    out = []
    for rep in range(repeats):
        lists = {d: list(rng.permutation(ids)) for d, ids in per_device.items()}
        turn = devices[rep % len(devices):] + devices[:rep % len(devices)]
        for k in range(max(map(len, lists.values()))):
            for c in range(0, len(turn), together):  # `together` devices at a time
                out.append([int(lists[d][k % len(lists[d])]) for d in turn[c:c + together]])
        for k, i in enumerate(rng.permutation(wide).tolist()):
            others = [d for d in turn if d not in (jobs[i].device, jobs[i].lender)][:max(together - 2, 0)]
            out.append([i] + [int(lists[d][k % len(lists[d])]) for d in others])
    return out


def _at_once(executor: Executor) -> int:
    """How many devices step at once in a `together` calibration. CPU devices are threads on the
    host's cores: with more of them stepping than there are cores, each step also waits for a
    core, which in serving happens only while every device is busy; so at most as many as the
    cores (on 2 cores with three devices, all three at once made the serving benchmark's
    prediction of `dedicated` 1.6-4.2x pessimistic, two at once 1.2-2.5x). GPU devices: all."""
    n = executor.num_devices
    if any(d.cuda for d in executor.devices):
        return n
    return max(1, min(n, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def calibrate_serving(models: Mapping[str, ModelSpec], factories: Mapping[str, Callable[[torch.device], PagedModel]],
                      executor: Executor, devices: Mapping[str, int], grid: Sequence[StepShape] = GRID,
                      repeats: int = 10, together: bool | int = False, seed: int = 0, wide: bool = True,
                      device_names: Sequence[str] = (), workers: DeviceWorkers | None = None) -> Profile:
    """Time every tenant's steps over `grid` on its device of `executor` (`devices`: tenant ->
    device) and return them as a profile (stage and dispatch rows). `together`: devices run one
    of their steps at the same time (contending for the host, as served tenants do): a number,
    that many at a time; True, every device, or on CPU devices as many as the host has cores
    (`_at_once`); else one step at a time. `wide`: each tenant's steps also run tensor-parallel
    over its device and the next one (shards staged there), priced as its TP-2 blocks: the wide
    iterations SliceScheduler's loans run (`executor/wide.py`). `device_names`: per executor
    device, the device type of the served cluster it stands for (the key a `CalibratedCostModel`
    prices that cluster's devices by; default `cpu`). `workers`: the steps run on these device
    workers (`remote.py`), their round trips priced with them (wide ones across their processes)."""
    cluster = Cluster.homogeneous("cpu", 1, executor.num_devices, intra_link="local")
    gmg = GlobalMappingGraph(cluster, dict(models), {t: Container(t, (d,)) for t, d in devices.items()})
    backend = ExecutorBackend(executor, gmg, factories, workers=workers)
    lenders = _stage_lenders(backend, models, devices) if wide else {}
    jobs, blocks = _jobs(models, devices, grid, seed, lenders)
    samples: list[list[tuple[np.ndarray, float]]] = [[] for _ in jobs]
    graphs: list[IterationGraph | None] = [None] * len(jobs)
    for j in jobs:  # write each job's context once, then run it once: warms the models up
        if any(j.shape.context):
            _run(backend, models, [(j, _inputs(j, blocks, warm=True))])
        _run(backend, models, [(j, _inputs(j, blocks))])
    at_once = _at_once(executor) if together is True else int(together)
    for ids in _rounds(jobs, repeats, at_once, np.random.default_rng(seed)):
        for i, (g, stages, dispatch) in zip(ids, _run(backend, models, [(jobs[i], _inputs(jobs[i], blocks)) for i in ids])):
            graphs[i] = g
            samples[i].append((stages, dispatch))
    rows = []
    for j, g, s in zip(jobs, graphs, samples):
        name = device_names[j.device] if device_names else cluster.device_specs[j.device].name
        rows += _rows(g, np.stack([x for x, _ in s]), np.array([d for _, d in s]), name)
    df = pd.DataFrame(rows)
    df.insert(1, "torch_version", torch.__version__)
    df.insert(2, "kernel_backend", f"executor/serving-steps/threads{torch.get_num_threads()}")
    return Profile(df, "serving-calibration")
