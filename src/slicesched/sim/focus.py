"""Focused forks: a what-if about some devices holds only the work that can reach them.

Devices interact only through slices mapped onto them (an iteration's slices may span several
groups), the memory on them and the transfers into and out of them (a transfer's bandwidth
resources are its own devices' links, so it shares them only with transfers touching one of
those devices). The closure of a seed of devices under those relations (`_reach`) therefore
evolves exactly as it would in a fork of the whole cluster; `Simulator.fork(focus=...)` copies
only that closure and `_within_focus` keeps later decisions inside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from slicesched.decisions import SchedulerDecision


class FocusMixin:
    """The closure of a focus and the part of a decision inside it, for `Simulator`."""

    def _reach(self: Any, seed: frozenset[int],
               decision: SchedulerDecision | None = None) -> tuple[frozenset[int], frozenset[int]]:
        """The devices and live iterations a fork focused on `seed` must hold: grown from the
        seed by every iteration mapped onto a reached device (all its groups' devices, and the
        groups `decision` places it on) and every transfer touching one (both ends, and the
        copies `decision` starts), until nothing new is reached."""
        ahead = () if decision is None else (tuple((p.first_slice, p.num_slices, p.group) for p in decision.placements),
                                             tuple((c.src_device, c.dst_device) for c in decision.weight_copies))
        state = (self._stamp, self._ver, self.gmg.weights_version, seed, ahead)
        memo = self._reach_memo
        if memo is not None and memo[0] == state:  # a scheduler's forks of one state and focus
            return memo[1]
        devs_of = self._devs
        spans: dict[int, set[int]] = {}
        for key, groups in self._spans.items():
            spans[key] = {d for g in groups for d in devs_of(g)}
        for r in self._running.values():  # mapped before this simulator kept spans (restored states)
            spans.setdefault(r.info.key, set()).update(devs_of(r.group))
        links = self.net.links()
        if decision is not None:
            for p in decision.placements:
                for key in self._keys_of(p.first_slice, p.num_slices):
                    spans.setdefault(key, set()).update(devs_of(p.group))
            links = links | {frozenset(d for d in (c.src_device, c.dst_device) if d >= 0) for c in decision.weight_copies}
        reach, keys = set(seed), set()
        grown = True
        while grown:
            grown = False
            for key, ds in spans.items():
                if key not in keys and not reach.isdisjoint(ds):
                    keys.add(key)
                    grown |= not ds <= reach
                    reach |= ds
            for ds in links:
                if not ds <= reach and not reach.isdisjoint(ds):
                    reach |= ds
                    grown = True
        out = (frozenset(reach), frozenset(keys))
        self._reach_memo = (state, out)
        return out

    def _keys_of(self: Any, first: int, n: int) -> tuple[int, ...]:
        """The iterations slices first..first+n-1 belong to (keys never decrease along ids)."""
        col, m = self.gmg.raw("iteration"), self.gmg.mask
        lo, hi = int(col[first & m]), int(col[(first + n - 1) & m])
        if lo == hi:
            return (lo,)
        return tuple(int(k) for k in np.unique(col[np.arange(first, first + n) & m]))

    def _within_focus(self: Any, decision: SchedulerDecision) -> SchedulerDecision:
        """The part of a decision a focused fork acts on: what touches none of its devices is
        left out; what would carry its work out of them (or bring outside work in) is an error."""
        devs, keys = self._focus  # type: ignore[misc]
        iteration, mask = self.gmg.raw("iteration"), self.gmg.mask

        def keep(what: object, touched: set[int], key: int | None = None) -> bool:
            inside = not touched.isdisjoint(devs)
            # an iteration the fork does not hold was mapped outside the focus: it may not come in
            if inside and touched <= devs and (key is None or key in self.gmg.iterations):
                return True
            if inside or (key is not None and key in keys):
                raise ValueError(f"{what}: reaches outside the fork's focus (devices {sorted(devs)})")
            return False

        places = []
        for p in decision.placements:
            key = int(iteration[p.first_slice & mask])
            if keep(p, set(self._devs(p.group)), key):
                keys.add(key)  # a fresh iteration placed inside is inside from now on
                places.append(p)
        copies = tuple(c for c in decision.weight_copies if keep(c, {d for d in (c.src_device, c.dst_device) if d >= 0}))
        evictions = tuple(e for e in decision.evictions if keep(e, {e.device}))
        return dataclasses.replace(decision, placements=tuple(places), weight_copies=copies, evictions=evictions)
