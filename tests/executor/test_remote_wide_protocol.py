"""The wide-step protocol between a home worker and a lender (`executor/remote_wide.py`), its two
sides run here as threads joined by a real gloo group: a lender whose mirror is made anew (its
process restarted, its shards staged again) is sent the KV it lacks though home had sent it
before, and the tokens stay eager's."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from step_helpers import PROMPT, HandFed
from slicesched.executor.remote_wide import WidePlan, WorkerWide
from slicesched.executor.serving import PagedModel, build_model, greedy_reference, scaled_config, shipped_config

CFG = scaled_config(shipped_config("llama-3-8b"))
ORDER = (0, 1)


def _connect(store: dist.TCPStore, name: str, *sides: WorkerWide) -> None:
    joins = [threading.Thread(target=w.connect, args=(ORDER, r, name, "127.0.0.1", store.port))
             for r, w in enumerate(sides)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(60)


def _lender(layers: int) -> WorkerWide:
    lender = WorkerWide("cpu")
    for block in range(2 * layers + 2):
        lender.stage("a", lambda: build_model(CFG, 1), block, 1, 2)
    return lender


def _wide_step(home: WorkerWide, lender: WorkerWide, model: PagedModel, fed: HandFed, n: int) -> None:
    """One step of request 0 (`n` tokens), every layer stage over home and lender."""
    entries = [(0, n)]
    inputs = fed.inputs(entries)
    plan = WidePlan(ORDER, tuple(range(1, model.num_stages - 1)))
    got: dict = {}
    part = threading.Thread(target=lambda: got.update(work=lender.run_lender("a", inputs, plan, 1, True)))
    part.start()
    out, _, work = home.run_home(model, inputs, plan, time.perf_counter)
    part.join(60)
    assert work.ran and got["work"].ran
    fed.take(entries, out)


def test_a_lenders_mirror_made_anew_is_sent_what_it_lacks_and_tokens_stay_eager():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = PagedModel(build_model(CFG, 1))
    layers = len(model.inner.layers)
    home, lender = WorkerWide("cpu"), _lender(layers)
    _connect(store, "first", home, lender)
    fed = HandFed(model, {0: PROMPT}, pool=("a", 0))
    _wide_step(home, lender, model, fed, len(PROMPT))  # the prompt's KV goes to the mirror
    _wide_step(home, lender, model, fed, 1)
    restarted = _lender(layers)  # a new process: no mirror; home was told nothing
    _connect(store, "second", home, restarted)
    for _ in range(2):
        _wide_step(home, restarted, model, fed, 1)
    assert tuple(fed.seqs[0][len(PROMPT):]) == greedy_reference(build_model(CFG, 1), PROMPT, 4)
