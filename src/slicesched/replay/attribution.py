"""Which tenant's work kept each device busy: the compute seconds of every iteration's done
slices, tallied per tenant and device group as iterations retire (the harvest metric needs each
slice's tenant, which the GMG forgets at retirement), read from the GMG's rows or, on the
iteration lane, from the lane."""

from __future__ import annotations

import numpy as np

from slicesched.gmg import GlobalMappingGraph, SliceState
from slicesched.hardware.cluster import Cluster
from slicesched.sim.lane import IterationLane


class Attribution:
    """Compute seconds per tenant and device group for one replay (owns the tally)."""

    def __init__(self, gmg: GlobalMappingGraph, cluster: Cluster, lane: IterationLane | None) -> None:
        self.gmg, self.cluster, self.lane = gmg, cluster, lane
        self.group_busy: dict[str, np.ndarray] = {}  # tenant -> compute seconds per device group

    def attribute_key(self, key: int, tally: dict[str, np.ndarray] | None = None, finished: bool = True) -> None:
        """`attribute` of iteration `key`, from the GMG or, on the lane, from the lane."""
        if self.lane is None:
            self.attribute(self.gmg.iterations[key], tally, finished)
            return
        tenant, group, secs = self.lane.busy_seconds(key, finished)
        acc = (self.group_busy if tally is None else tally).get(tenant)
        if acc is not None and group < len(acc):
            acc[group] += secs  # what adding the one-group array below does
            return
        by_group = np.zeros(group + 1)
        by_group[group] = secs
        self._add_seconds(tenant, by_group, tally)

    def attribute(self, it, tally: dict[str, np.ndarray] | None = None, finished: bool = True) -> None:
        """Add the compute seconds of an iteration's done slices (`it`: a GMG live iteration, its
        rows not yet reused; `finished`: all of them done) to its tenant's tally per device
        group. Runs once per iteration, so a handful of numpy calls on views of the ring columns."""
        gmg, n = self.gmg, it.graph.num_slices
        idx = gmg.rows(it.base, n)
        # a finished iteration's rows are final: read them as written, not settling the whole GMG
        col = gmg.raw if finished else gmg.col
        groups, start, end = col("group")[idx], col("start_t")[idx], col("end_t")[idx]
        if not finished:
            done = gmg.col("state")[idx] == SliceState.DONE
            groups, start, end = groups[done], start[done], end[done]
        self._add_seconds(it.graph.tenant, np.bincount(groups, end - start), tally)

    def _add_seconds(self, tenant: str, secs: np.ndarray, tally: dict[str, np.ndarray] | None) -> None:
        """Add per-group compute seconds `secs` to the tenant's tally."""
        tally = self.group_busy if tally is None else tally
        acc = tally.get(tenant)
        if acc is None or len(acc) < len(secs):
            acc = tally[tenant] = np.pad(np.zeros(0) if acc is None else acc,
                                         (0, len(secs) - (0 if acc is None else len(acc))))
        acc[:len(secs)] += secs

    def tenant_busy(self) -> dict[int, dict[str, float]]:
        """Per device, compute seconds per tenant: retired iterations, and live ones' done slices."""
        tally = {t: acc.copy() for t, acc in self.group_busy.items()}
        for key in (self.gmg.iterations if self.lane is None else self.lane.live_keys()):
            self.attribute_key(key, tally, finished=False)
        out: dict[int, dict[str, float]] = {d: {} for d in range(self.cluster.num_devices)}
        for t, acc in tally.items():
            for gid in np.flatnonzero(acc):
                for d in self.cluster.group(int(gid)):
                    out[d][t] = out[d].get(t, 0.0) + float(acc[gid])
        return out
