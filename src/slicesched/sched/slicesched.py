"""SliceScheduler: a busy tenant's iterations run tensor-parallel over its own devices plus
idle devices of other containers, decided per iteration by what-if simulation.

Policy (v2), on top of `dedicated` (see ARCHITECTURE.md):

- *Leases* (every `check_interval_s`). Only the hottest tenants borrow (load forecast at least
  `borrower_share` of the hottest's): each home replica leases as many devices as it has from
  calm containers (no requests of their own beyond `lender_max_load`, forecast at most
  `lender_forecast_frac` of the borrower's; on the borrower's node only, since tensor parallel
  over the inter-node fabric loses more than it gains; calmest, then idlest recent
  history over `idle_window_s`; a lender never borrows, a borrower's devices are never lent).
  `ShardStage` copies the tenant's weight shards at the union's degree there, ahead of need, in
  memory the owners lend from their free KV pool (at most `lend_frac`), part of it a KV mirror
  for the borrower's KV heads of the shard. A what-if fork applies the copies and runs
  `stage_horizon_s` ahead first: refused on a predicted OOM or a peak beyond capacity (at most
  `memory_whatifs_per_check` such forks per check; later candidates wait for the next one).
  `ShardRelease` gives the memory back when the lender's KV pool fills (`reclaim_kv_frac`) or
  its load forecast passes `reclaim_forecast_frac` of the borrower's (hysteresis over the staging
  rule: a restage copies every shard again), when the borrower is calm or no longer among the hottest,
  once no unfinished slice of the borrower is mapped there.
- *Placement* (every call). Each live iteration of a leased replica runs WHOLE (every slice
  tensor-parallel over the union; needs room in the KV mirror; the driver then pays the copy of
  the borrowed heads' KV home before the iteration completes), MLP (only MLP slices on the union:
  no KV needed there; activations move over the fabric in the simulator) or HOME. Two what-if
  forks (home and the candidate, with everything placed so far) decide: wide only if the
  iteration ends at least `min_gain_frac` sooner and every live lender iteration ends at most
  `lender_slack_frac` x its TPOT SLO later than without the loan. With no lender work live the
  verdict depends only on the shape and hardware and is reused for `whatif_reuse_s`.
- *Overflow replicas* (every `check_interval_s`, before leases: a whole replica of its own
  serves more than a loan of the same devices): a hot tenant (forecast at least
  `guest_min_forecast`) gets a `GuestStart` for each of its home replicas that has none, its
  whole replica at its own degree on calm devices of any one node (the lender rules; weights
  from host memory plus KV for one whole context within what they lend; memory what-if first;
  its prefill chunk cut until each slice takes at most `guest_slice_frac` of the owner's decode
  step, where some chunk can); the driver routes arrivals there by predicted TTFT once its weights are resident; it
  leaves at once when a lender's own requests stay queued over two checks, and drains by the
  lease rules or when its tenant calms. Leases
  take the calm devices left (or those whose free memory holds shards but not a whole replica). No lease or guest before a whole
  `idle_window_s` of history; lenders keep `kv_headroom` x their recent peak KV use.
- The lender has priority: when its own iteration appears the check is re-run and, unless the
  loan stays inside its slack, the borrower's unstarted slices are mapped back home (the lender
  gets its devices at the next slice boundary); when the lender is idle again they may go wide.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from slicesched.config.settings import SliceSchedConfig
from slicesched.decisions import TenantDemand
from slicesched.gmg.graph import GlobalMappingGraph, SliceState
from slicesched.gmg.ops import Grain, IterationGraph
from slicesched.models.spec import model_spec
from slicesched.sched.baselines import Replicas
from slicesched.sched.interface import (SCHEDULERS, GuestStart, GuestStop, PlacementView, Scheduler,
                                        SchedulerDecision, ShardRelease, ShardStage, SlicePlacement, StepOutcome)
from slicesched.sched.lending import Lease, LendingMixin, lease_fits, lending_layout, replica_heat
from slicesched.sched.policies import Deadline, PredictedTTFT, TPOTBudget
from slicesched.sim.placement import placement_runs

HOME, MLP, WHOLE = 0, 1, 2  # where an iteration of a leased replica runs
_RUNNING = int(SliceState.RUNNING)
_DONE = int(SliceState.DONE)


def mlp_slices(graph: IterationGraph) -> np.ndarray:
    """bool [num_slices]: slices made only of a layer's MLP half (need no KV cache)."""
    return _mlp_mask(graph.model, graph.tp, graph.grain, graph.num_slices, graph)


_MASKS: dict[tuple, np.ndarray] = {}


def _mlp_mask(model: str, tp: int, grain, n: int, graph: IterationGraph) -> np.ndarray:
    key = (model, tp, grain, n)
    m = _MASKS.get(key)
    if m is None:
        wb = graph.wblock.astype(np.int64)
        lo, hi = np.minimum.reduceat(wb, graph.slice_first), np.maximum.reduceat(wb, graph.slice_first)
        L2 = int(wb.max()) - 1  # blocks 0 .. 2L-1 are layers' (the embedding 2L, the head 2L+1)
        m = _MASKS[key] = (lo == hi) & (lo % 2 == 1) & (lo < L2)
    return m


def _bucket(x: int) -> int:
    return int(x).bit_length()


@dataclass(slots=True)
class RunReport:
    """What SliceScheduler did in one run (issue 10, item 8)."""

    wide_iterations: int = 0  # iterations with slices placed on borrowed devices
    whole_iterations: int = 0  # of which every slice ran tensor-parallel over the union
    slices_away: int = 0  # slices mapped onto a union group (home + borrowed devices)
    give_backs: int = 0  # iterations mapped back home because a lender's own work arrived
    stages: int = 0  # ShardStage decisions issued
    releases: int = 0
    guest_starts: int = 0  # overflow replicas started on calm devices
    guest_stops: int = 0
    staged_bytes: float = 0.0  # weight bytes the stages asked to copy (all devices)
    whatif_calls: int = 0
    memory_rejections: int = 0  # stages refused by the memory what-if
    deferred_loans: int = 0  # lease checks that left stage or overflow candidates for the next (what-if budget spent)
    slack_rejections: int = 0  # loans refused because a lender would leave its SLA slack
    gain_rejections: int = 0  # loans refused because the iteration would not end sooner
    decision_s: list[float] = field(default_factory=list)
    decision_cpu_s: list[float] = field(default_factory=list)  # the same, thread CPU time
    forecast_errors: list[tuple[int, float]] = field(default_factory=list)  # (wide, realized/forecast - 1)
    whatif_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        del d["decision_s"], d["decision_cpu_s"], d["forecast_errors"]
        for wide, name in ((0, "home"), (1, "wide")):  # predicted vs realized iteration completion
            err = [abs(e) for w, e in self.forecast_errors if w == wide]
            if err:
                d[f"{name}_forecast_error_median_pct"] = 100 * float(np.median(err))
                d[f"{name}_realized_over_forecast"] = 1 + float(np.median([e for w, e in self.forecast_errors
                                                                           if w == wide]))
        d["decisions"] = len(self.decision_s)
        if self.decision_s:
            p50, p99 = np.percentile(self.decision_s, [50, 99])
            d["decision_p50_ms"], d["decision_p99_ms"] = float(p50) * 1e3, float(p99) * 1e3
        return d


@SCHEDULERS.register("slicesched")
class SliceScheduler(LendingMixin, Scheduler):
    name = "slicesched"
    routing = PredictedTTFT()  # arrivals go where the least prefill work is queued
    batching = TPOTBudget()  # prefill riding with decodes kept within their TPOT SLO
    admission = Deadline()  # the most requests within their TTFT SLO first

    def __init__(self, models: dict[str, str] | None = None, config: SliceSchedConfig | None = None, *,
                 capacity_bytes: float | np.ndarray = 80e9, grain: Grain = Grain.BLOCK,
                 chunk_tokens: dict[str, int] | None = None, device_node: tuple[int, ...] | None = None) -> None:
        """`grain`: the replay's slice grain; `chunk_tokens`: each tenant's largest prefill chunk
        (its `max_batch_tokens`), which bound how long a guest's slice holds a lender's device;
        `device_node`: each device's node where the scenario leaves the containers' layout free
        (None: no tenant's devices or node group given)."""
        self.models = models or {}
        self.device_node = device_node
        self.grain, self.chunk_tokens = grain, chunk_tokens or {}
        self._slice_s: dict[tuple, float] = {}  # (tenant, tp, device type) -> a guest's longest slice
        self.cfg = config or SliceSchedConfig()
        self.capacity_bytes = capacity_bytes
        self.report = RunReport()
        self._view: PlacementView | None = None
        self._leases: dict[int, Lease] = {}  # home group -> lease (resident shards only)
        self._mode: dict[int, tuple[bool, bool]] = {}  # iteration key -> (wide, lender was live)
        self._last_busy: dict[int, float] = {}  # home group -> last time it had requests
        self._queued_since: dict[int, float] = {}  # home group -> first check of its requests' current queue
        self._releasing: set[int] = set()  # home groups whose lease is being given back
        self._next_check = 0.0
        self._whatif_budget = 0  # memory what-ifs left in this lease check
        self._now = 0.0
        self._memo: dict[tuple, tuple[int, float]] = {}  # shape class -> (mode, decided at)
        self._forecast: dict[str, float] = {}  # tenant -> forecast requests per replica
        self._forecast_end: dict[int, tuple[int, float, float]] = {}  # key -> (wide, decided at, forecast end)
        self._realized = [1.0, 1.0]  # realized / forecast duration, home and wide (exponential average)
        self._kv_seen: dict[int, deque[tuple[float, float]]] = {}  # group -> (time, KV use) over kv_peak_window_s

    @classmethod
    def from_scenario(cls, scenario) -> "SliceScheduler":
        cap = scenario.cluster.memory_per_device() * scenario.replay.gpu_memory_utilization
        return cls({t.name: t.spec() for t in scenario.tenants}, scenario.schedulers.slicesched, capacity_bytes=cap,
                   grain=Grain[scenario.replay.grain.upper()],
                   chunk_tokens={t.name: t.max_batch_tokens for t in scenario.tenants},
                   device_node=_free_layout(scenario))

    def deployment(self, default: Replicas, demand: Mapping[str, TenantDemand] | None = None) -> Replicas:
        """The scenario's containers, each hot one on a node with calm ones to borrow from
        (`lending_layout`), where the scenario leaves the layout free and the load forecast is known."""
        if not self.cfg.lending_layout or self.device_node is None or not demand:
            return default
        heat = replica_heat(default, self.models, dict(demand))
        holds = lease_fits(default, self.models, float(np.min(self.capacity_bytes)), self.cfg.lend_frac)
        return lending_layout(default, self.device_node, heat, self.cfg.borrower_share, holds)

    def run_report(self) -> dict[str, float]:
        return self.report.as_dict()

    def attach(self, view: PlacementView) -> None:  # type: ignore[override]
        self._view = view

    # ---- every call ---------------------------------------------------------------------------
    def schedule(self, gmg: GlobalMappingGraph, now: float) -> SchedulerDecision:
        import time

        t0, c0 = time.perf_counter(), time.thread_time()
        self._now = now
        stages: tuple[ShardStage, ...] = ()
        releases: tuple[ShardRelease, ...] = ()
        starts: tuple[GuestStart, ...] = ()
        stops: tuple[GuestStop, ...] = ()
        # leases and overflow replicas need the what-if service (the executor has none)
        if self._view is not None and now >= self._next_check and self._view.whatif() is not None:
            self._next_check = now + self.cfg.check_interval_s
            stages, releases, starts, stops = self._refresh_leases(gmg, now)
        placements = self._placements(gmg, now)
        self.report.decision_s.append(time.perf_counter() - t0)
        self.report.decision_cpu_s.append(time.thread_time() - c0)
        return SchedulerDecision(now, placements, shard_stages=stages, shard_releases=releases,
                                 guest_starts=starts, guest_stops=stops)

    def _placements(self, gmg: GlobalMappingGraph, now: float) -> tuple[SlicePlacement, ...]:
        homes, mask = gmg.col("home"), gmg.mask
        out: list[SlicePlacement] = []
        leased: list[int] = []
        for s in gmg.unmapped_ready().tolist():  # owners first: the what-ifs must see them placed
            home = int(homes[s & mask])
            it, local = gmg.iteration_of(s)
            lease = self._leases.get(home)
            if lease is not None and lease.tenant == it.graph.tenant:
                leased.append(int(gmg.get("iteration", s)))
            else:
                out.append(SlicePlacement(s, home, it.graph.num_slices - local))
        if not self._leases:
            return tuple(out)
        live_lender = self._lender_live(gmg)
        keys = set(leased)
        for key, it in gmg.iterations.items():  # live iterations already mapped: re-decide on changes
            lease = self._leases.get(int(homes[it.base & mask]))
            if lease is not None and lease.tenant == it.graph.tenant and key in self._mode \
                    and self._mode[key][1] != (lease.union in live_lender or lease.home_group in self._releasing):
                keys.add(key)
        for key in sorted(keys):
            it = gmg.iterations[key]
            lease = self._leases[int(homes[it.base & mask])]
            lender_live = lease.union in live_lender
            if lease.home_group in self._releasing:
                wide = HOME
            else:
                wide = self._decide(gmg, key, lease, out, live_lender.get(lease.union, ()))
            was = self._mode.get(key)
            self._mode[key] = (wide, lender_live or lease.home_group in self._releasing)
            if was is not None and was[0] and not wide:
                self.report.give_backs += 1
            if wide and (was is None or not was[0]):
                self.report.wide_iterations += 1
                self.report.whole_iterations += wide == WHOLE
            out += self._mapping(gmg, key, lease, wide, count=True)
        if len(self._mode) > 4096:
            self._mode = {k: v for k, v in self._mode.items() if k in gmg.iterations}
        if len(self._forecast_end) > 4096:  # aborted iterations never report an end
            self._forecast_end = {k: v for k, v in self._forecast_end.items() if k in gmg.iterations}
        return tuple(out)

    def _lender_live(self, gmg: GlobalMappingGraph) -> dict[int, tuple[int, ...]]:
        """Union group -> keys of live iterations of the lease's lenders (their own work)."""
        if not self._leases:
            return {}
        homes, mask = gmg.col("home"), gmg.mask
        by_dev: dict[int, list[int]] = defaultdict(list)
        for lease in self._leases.values():
            for d in lease.devices:
                by_dev[d].append(lease.union)
        out: dict[int, list[int]] = defaultdict(list)
        for key, it in gmg.iterations.items():
            h = int(homes[it.base & mask])
            if h < 0:
                continue
            for d in gmg.cluster.group(h):
                for u in by_dev.get(d, ()):
                    if key not in out[u]:
                        out[u].append(key)
        return {u: tuple(k) for u, k in out.items()}

    def _mapping(self, gmg: GlobalMappingGraph, key: int, lease: Lease, wide: int,
                 count: bool = False) -> list[SlicePlacement]:
        """Placements that map the iteration's unstarted slices home (HOME), its MLP slices on the
        union (MLP), or all of them on the union (WHOLE)."""
        it = gmg.iterations[key]
        n = it.graph.num_slices
        ids = np.arange(it.base, it.base + n)
        group = gmg.raw("group")[ids & gmg.mask]  # mappings are exact unsettled
        mapped = bool((group >= 0).any())
        if not mapped and wide != MLP:  # nothing mapped, so nothing started: the whole iteration at once
            target = lease.union if wide == WHOLE else lease.home_group
            if count and wide:
                self.report.slices_away += n
            return [SlicePlacement(it.base, target, n)]
        # a slice starts only once mapped: for an iteration not mapped yet, no read of its
        # progress (which would make the simulator write out every running chain's steps)
        state = gmg.get("state", ids) if mapped else np.zeros(n, np.int64)
        want = np.full(n, lease.home_group, np.int64)
        if wide == WHOLE:
            want[:] = lease.union
        elif wide == MLP:
            want[mlp_slices(it.graph)] = lease.union
        todo = np.flatnonzero((state < _RUNNING) & (group != want))
        if not len(todo):
            return []
        if count and wide:
            self.report.slices_away += int((want[todo] == lease.union).sum())
        return placement_runs(it.base, todo, want[todo])

    def _decide(self, gmg: GlobalMappingGraph, key: int, lease: Lease, placed: list[SlicePlacement],
                lender_keys: tuple[int, ...]) -> int:
        """What-if: does the iteration end sooner wide, with every lender iteration inside its slack?

        With no lender iteration live, the answer depends on the iteration's shape alone (the
        borrower runs one iteration at a time on its devices) and the hardware, so it is reused
        for `whatif_reuse_s` for iterations of the same model, group sizes, devices and fabric
        and shape class (tokens, sequences, context, rounded to powers of two); with a lender
        live it is always simulated."""
        memo = None
        if not lender_keys:
            shape = gmg.iterations[key].graph.shape
            c = gmg.cluster
            memo = (gmg.iterations[key].graph.model, len(lease.home), len(lease.devices),
                    c.group_intra_link(lease.union).name, c.device_specs[lease.home[0]].name,
                    _bucket(shape.num_tokens), _bucket(shape.num_seqs), _bucket(shape.kv_tokens_read()))
        mode = self._candidate(gmg, key, lease)
        if memo is not None:
            memo += (mode,)
            hit = self._memo.get(memo)
            if hit is not None and self._now - hit[1] < self.cfg.whatif_reuse_s:
                return hit[0]
        ok = mode if self._simulate_choice(gmg, key, lease, placed, lender_keys, mode) else HOME
        if memo is not None:
            self._memo[memo] = (ok, self._now)
        return ok

    def _candidate(self, gmg: GlobalMappingGraph, key: int, lease: Lease) -> int:
        """WHOLE when the lease's KV mirror has room for this iteration's KV, else MLP."""
        if lease.mirror_bytes <= 0:
            return MLP
        graph = gmg.iterations[key].graph
        per_tok = model_spec(self.models[graph.tenant]).kv_bytes_per_token() / (len(lease.home) + len(lease.devices))
        return WHOLE if lease.mirror_used + graph.shape.num_tokens * per_tok <= lease.mirror_bytes else MLP

    def _sync_estimate(self, gmg: GlobalMappingGraph, key: int, lease: Lease) -> float:
        """Cost-model seconds to copy a whole-wide iteration's borrowed KV heads home."""
        graph = gmg.iterations[key].graph
        nbytes = graph.shape.num_tokens * model_spec(self.models[graph.tenant]).kv_bytes_per_token() / (
            len(lease.home) + len(lease.devices))
        return self.cost.transfer_time(nbytes, gmg.cluster.link(lease.home[0], lease.devices[0]))

    def _simulate_choice(self, gmg: GlobalMappingGraph, key: int, lease: Lease, placed: list[SlicePlacement],
                         lender_keys: tuple[int, ...], mode: int) -> bool:
        horizon = min(self.cfg.horizon_s, 2.0 * self._home_estimate(gmg, key, lease) + 2e-3)
        try:
            watch = (key, *lender_keys)  # the forks run until these end: the verdict reads nothing later
            # forks of just the lease's devices and what reaches them: the verdict reads nothing else
            focus = gmg.cluster.group(lease.union)
            home = self._predict(gmg, placed + self._mapping(gmg, key, lease, HOME), horizon, watch, focus)
            wide = self._predict(gmg, placed + self._mapping(gmg, key, lease, mode), horizon, watch, focus)
        except ValueError as e:
            # The fork re-times running work from the cost model alone, so it may already have
            # started a slice that reality has not: no verdict, and the iteration stays home.
            if "already started" not in str(e):
                raise
            self.report.gain_rejections += 1
            return False
        t_home, t_wide = home.iteration_end.get(key, np.inf), wide.iteration_end.get(key, np.inf)
        # The fork cannot see the lenders' future arrivals; a wide iteration advances only while
        # every lent device is free of its owners' work: stretch it by their recent busy share.
        t_wide = t_ends = home.start + (t_wide - home.start) / (1.0 - lease.interference)
        if mode == WHOLE:  # its completion waits for the KV copy home (after its GMG end)
            t_wide += self._sync_estimate(gmg, key, lease)
        # what realized iterations taught: wide ones ran r_wide x their forecast, home ones r_home x
        t0 = home.start
        t_judged = t0 + (t_wide - t0) * self._realized[1] / self._realized[0]
        if not np.isfinite(t_wide) or t_judged > t_home - self.cfg.min_gain_frac * max(t_home - t0, 0.0):
            self.report.gain_rejections += 1
            self._forecast_end[key] = (0, t0, t_home)
            return False
        for k in lender_keys:
            it = gmg.iterations.get(k)
            if it is None:
                continue
            sla = self._view.sla_of(it.graph.tenant)
            slack = self.cfg.lender_slack_frac * (sla.tpot_s if sla is not None else 0.0)
            end_wide, end_home = wide.iteration_end.get(k, np.inf), home.iteration_end.get(k, np.inf)
            if not np.isfinite(end_wide) or end_wide - end_home > slack:
                self.report.slack_rejections += 1
                self._forecast_end[key] = (0, t0, t_home)
                return False
        self._forecast_end[key] = (1, t0, t_ends)
        return True

    def update(self, outcome: StepOutcome) -> None:
        """Score the forecasts of iterations that ended (the backend returns at an iteration's
        end, so `outcome.time` is it): the error for the report, the ratio for later verdicts."""
        for key in outcome.finished_iterations:
            f = self._forecast_end.pop(key, None)
            if f is None or not f[2] > f[1]:
                continue
            wide, t0, end = f
            ratio = (outcome.time - t0) / (end - t0)
            self.report.forecast_errors.append((wide, ratio - 1.0))
            a = self.cfg.forecast_weight
            self._realized[wide] = (1 - a) * self._realized[wide] + a * ratio

    def _home_estimate(self, gmg: GlobalMappingGraph, key: int, lease: Lease) -> float:
        """Cost-model seconds of the iteration alone at home: bounds how far the forks run."""
        graph = gmg.iterations[key].graph
        spec = gmg.cluster.device_specs[lease.home[0]]
        return float(self.cost.op_times(graph, spec, gmg.cluster.group_intra_link(lease.home_group)).sum())

    def _predict(self, gmg: GlobalMappingGraph, placements: list[SlicePlacement], horizon: float,
                 watch: tuple[int, ...], focus: tuple[int, ...]):
        import time

        t0 = time.perf_counter()
        self.report.whatif_calls += 1
        fork = self._view.whatif().fork(focus, SchedulerDecision(self._now, tuple(placements)))
        pred = fork.simulate(horizon, stop_after=watch)
        self.report.whatif_s += time.perf_counter() - t0
        return pred


def _free_layout(scenario) -> tuple[int, ...] | None:
    """Each device's node, if the scenario leaves SliceScheduler to lay its containers out: no
    tenant's devices or node group given, one kind of server."""
    c = scenario.cluster
    if c.node_groups or any(t.devices is not None or t.node_group is not None for t in scenario.tenants):
        return None
    return tuple(int(n) for n in c.build().device_node)
