"""Incremental what-ifs: re-simulate only from where a placement change can matter.

A scheduler weighing many variants of one decision (move this run there, or there...) asks
`Incremental(sim, decision, horizon)` once: it runs the decision to the horizon while recording
(1) the stamp at which the engine first read each slice's mapping, (2) a digest of the state
after every event, (3) checkpoints (exact state copies) every `every` events, and (4) each event's
memory peak window. `predict(change)` then:

1. finds the earliest stamp at which any slice of `change` was read; nothing before it can
   depend on their mapping, so it restores the latest checkpoint before that stamp (if the
   slices were never read, the change cannot matter inside the horizon and the recorded
   prediction is returned as is);
2. applies the change and re-simulates from there, comparing the state after each event with
   the recorded state at the same point of the base run (the last base event not after it);
3. stops as soon as they are equal and the changed slices are done with their outputs freed
   (their mapping can no longer matter): the future is then the base run's future;
4. splices rows by stamp (base rows before the checkpoint, re-simulated rows, base rows after
   the reconvergence point) and builds the prediction from them.

The reference it must equal is a full re-simulation: fork, apply the decision, apply the change,
simulate. Ties are ordered by the heap key alone (see events.py), so a run restored mid-way
orders them exactly as the full run does.
"""

from __future__ import annotations

import bisect

import numpy as np

from slicesched.gmg.graph import SliceState
from slicesched.decisions import SchedulerDecision, SlicePlacement
from slicesched.sim.engine import Simulator
from slicesched.sim.forks import digest, same_state
from slicesched.sim.prediction import Prediction, RunLog, build_prediction

_NEVER = 1 << 62
_DONE = int(SliceState.DONE)


class Incremental:
    """A recorded what-if of `decision` over `horizon_s` that answers placement changes cheaply."""

    def __init__(self, sim: Simulator, decision: SchedulerDecision, horizon_s: float, every: int = 1) -> None:
        """`every`: events between checkpoints. A what-if horizon holds a few dozen events at
        most, so a checkpoint at each one (a state copy each, paid once here) keeps the
        re-simulation of every variant as short as it can be; raise it for long horizons."""
        self._sim, self._decision, self.horizon_s = sim, decision, horizon_s
        self.t1 = sim.now + horizon_s
        self.every = every
        base = sim.forks.recording_copy()
        self._ckpts: list[tuple[int, Simulator]] = [(base.stamp, base.snapshot())]
        base.apply(decision)
        base.reads.mark_ready(base)
        self._windows: list[tuple[int, list[float]]] = [(base.stamp, base.mem.take_window_peak())]
        self._ckpts.append((base.stamp, base.snapshot()))
        self._keys: list[tuple] = []
        self._stamps: list[int] = []
        self._digests: list[tuple] = []
        base.watch(self._record)
        base.advance(self.t1)
        base.watch(None)
        self._windows.append((base.stamp, base.mem.take_window_peak()))
        self._base = base
        self._first_read = self._merge_reads(base)
        self.prediction = self._build(base.log, base.tail(), self._peak(None, None, None))

    # ---- recording -------------------------------------------------------------------------
    def _merge_reads(self, base: Simulator) -> dict[int, int]:
        """Per slice, the stamp before which its mapping cannot have mattered: a real read's
        stamp, or for a segment's read the first event after the point where per-slice events
        would have read it (reads past the horizon do not count)."""
        first = dict(base.reads.first)
        for x, key in base.reads.soft.items():
            if key[0] > self.t1:
                continue
            i = bisect.bisect_right(self._keys, key)
            stamp = self._stamps[i] if i < len(self._stamps) else base.stamp
            if stamp < first.get(x, _NEVER):
                first[x] = stamp
        return first

    def _record(self, sim: Simulator) -> None:
        stamp = sim.stamp
        self._keys.append(sim.event_key)
        self._stamps.append(stamp)
        self._digests.append(digest(sim))
        self._windows.append((stamp, sim.mem.take_window_peak()))
        if len(self._keys) % self.every == 0:
            self._ckpts.append((stamp, sim.snapshot()))

    # ---- queries ---------------------------------------------------------------------------
    def full(self, change: SlicePlacement) -> Prediction:
        """The reference: fork, apply the decision, apply the change, simulate everything."""
        f = self._sim.fork()
        f.apply(self._decision)
        f.apply(SchedulerDecision(f.now, (change,)))
        return f.simulate(self.horizon_s)

    def predict(self, change: SlicePlacement) -> Prediction:
        """The prediction with `change` applied after the decision, re-simulating only what it affects."""
        ids = change.slice_ids()
        read = min((self._first_read.get(x, _NEVER) for x in ids), default=_NEVER)
        if read == _NEVER:
            return self.prediction
        c = bisect.bisect_left([s for s, _ in self._ckpts], read) - 1
        if c < 0:
            return self.full(change)
        stamp, ckpt = self._ckpts[c]
        run = ckpt.snapshot()
        if c == 0:  # the checkpoint before the decision itself
            run.apply(self._decision)
        run.apply_in_place(SchedulerDecision(run.now, (change,)))
        return self._resume(run, stamp, ids)

    def _resume(self, run: Simulator, upto: int, changed: range) -> Prediction:
        state, m = run.gmg.raw("state"), run.gmg.mask
        unsettled = list(changed)  # changed slices not yet done with their outputs freed
        while run.next_time() <= self.t1:
            run.process()
            i = bisect.bisect_right(self._keys, run.event_key) - 1
            if i < 0 or self._stamps[i] <= upto:
                continue
            # a slice once done with its output freed stays so: drop settled ones from the end
            while unsettled and state[unsettled[-1] & m] == _DONE and unsettled[-1] not in run.placement.outputs:
                unsettled.pop()
            if not unsettled and same_state(run, self._digests[i]):
                after = self._stamps[i]
                log = self._base.log.spliced(upto, run.log, after)
                return self._build(log, self._base.tail(), self._peak(upto, run, after))
        run.advance(self.t1)
        log = self._base.log.spliced(upto, run.log, _NEVER)
        return self._build(log, run.tail(), self._peak(upto, run, None))

    # ---- assembling ------------------------------------------------------------------------
    def _peak(self, upto: int | None, run: Simulator | None, after: int | None) -> np.ndarray:
        """Peak per device: base windows up to `upto`, the re-simulated run, base windows after `after`."""
        rows = [w for s, w in self._windows if upto is None or s <= upto or (after is not None and s > after)]
        if run is not None:
            rows.append(run.mem.peak_seen)
        return np.max(np.array(rows, np.float64), axis=0)

    def _build(self, log: RunLog, tail: list, peak: np.ndarray) -> Prediction:
        return build_prediction(self._base.gmg.cluster, self._base.mem.t0, self.t1, self._base.tracked, log, tail,
                                peak)
