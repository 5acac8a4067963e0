"""What one tenant reaches with the whole cluster to itself: an upper reference for a scenario
that one tenant dominates.

The tenant keeps its model, parallelism, SLOs and stream; the other tenants and their streams
are removed and its replicas fill every device (devices // (tp x pp)). Its capacity at SLA is
searched as `benchmarks/capacity.py` searches (20 s windows, the scenario's seeds s, s+1, s+2,
<= 9% violations), under `dedicated+slo`: whole replicas with SliceScheduler's serving rules.
When the tenant carries nearly all of a scenario's requests, no scheduler that serves it with
whole replicas under those rules can exceed this on the scenario, whatever it places where:
there are no idle devices left to harvest. Prints `ceiling_<scenario>_<tenant>: <scale> x` and
`request_share_<scenario>_<tenant>` (its share of the scenario's requests at x1, seed s).

    python benchmarks/ceiling.py hot_cold            # the tenant with the most requests
    python benchmarks/ceiling.py hot_cold --tenant hot -s dedicated+slo -s dedicated
    python benchmarks/ceiling.py hot_cold --refine 5  # 2.2% steps

The tenant must have streams of its own (a stream shared with other tenants is split between
them by the scenario, so it cannot be kept whole); a stream that is not the scenario's first is
drawn as another sample of the same process (each stream's seed follows its position).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from capacity import JOBS, SCENARIOS, WINDOW_S
from slicesched.config import load_scenario
from slicesched.config.scenario import Scenario
from slicesched.errors import InputError
from slicesched.replay.capacity import CapacitySettings, run_capacity
from slicesched.replay.workload import scenario_trace


def request_shares(sc: Scenario) -> Counter:
    """Each tenant's share of the scenario's requests at x1 (its own seed and window)."""
    counts = Counter(scenario_trace(sc, 1.0, WINDOW_S).tenant.tolist())
    total = sum(counts.values())
    return Counter({t: n / total for t, n in counts.items()})


def alone(sc: Scenario, tenant: str) -> Scenario:
    """`sc` with `tenant` alone on every device: the others and their streams removed."""
    t = next((t for t in sc.tenants if t.name == tenant), None)
    if t is None:
        raise InputError(f"no tenant {tenant!r}; tenants are {[x.name for x in sc.tenants]}")
    shared = [s for s in sc.streams if tenant in s.tenants and len(s.tenants) > 1]
    if shared:
        raise InputError(f"tenant {tenant!r} shares a stream with {[x for x in shared[0].tenants if x != tenant]}")
    replicas = sc.cluster.num_devices // t.replica_devices
    whole = t.model_copy(update={"replicas": replicas, "devices": None, "node_group": None})
    streams = tuple(s for s in sc.streams if s.tenants == (tenant,))
    return sc.model_copy(update={"name": f"{sc.name}-{tenant}-alone", "tenants": (whole,), "streams": streams})


def measure(name: str, tenant: str | None, schedulers: tuple[str, ...], refine: int = CapacitySettings().refine) -> None:
    sc = load_scenario(SCENARIOS[name])
    shares = request_shares(sc)
    tenant = tenant or shares.most_common(1)[0][0]
    solo = alone(sc, tenant)
    t0 = time.perf_counter()
    res = run_capacity(solo, schedulers, CapacitySettings(seeds=(sc.seed, sc.seed + 1, sc.seed + 2), refine=refine),
                       duration_s=WINDOW_S, jobs=JOBS)
    print(f"request_share_{name}_{tenant}: {shares[tenant]:.4f}")
    print(f"ceiling_replicas_{name}_{tenant}: {solo.tenants[0].replicas} replicas")
    for s, r in res.items():
        print(f"ceiling_{name}_{tenant}_{s}: {r.scale:.3f} x")
        print(f"ceiling_bracket_{name}_{tenant}_{s}: {r.bracket[0]:.3f}-{r.bracket[1]:.3f} x")
        print(f"ceiling_spread_{name}_{tenant}_{s}: {r.spread[0]:.3f}-{r.spread[1]:.3f} x")
    print(f"ceiling_search_wall_{name}: {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenarios", nargs="+", choices=list(SCENARIOS))
    ap.add_argument("--tenant", help="default: the tenant with the most requests")
    ap.add_argument("-s", "--scheduler", action="append", help="default: dedicated+slo")
    ap.add_argument("--refine", type=int, default=CapacitySettings().refine, choices=range(0, 9), metavar="N",
                    help="geometric bisections of each bracket, 0-8 (default %(default)s, as capacity.py)")
    args = ap.parse_args(argv)
    for name in args.scenarios:
        try:
            measure(name, args.tenant, tuple(args.scheduler or ("dedicated+slo",)), args.refine)
        except InputError as e:
            print(f"# {name}: skipped ({e.one_line()})")


if __name__ == "__main__":
    from _docs import record_if_asked

    record_if_asked("ceiling")
    main(sys.argv[1:])
