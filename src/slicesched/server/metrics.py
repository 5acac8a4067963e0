"""The endpoint's `/metrics`, in Prometheus' text format (`prometheus_client`).

Per tenant: TTFT and TPOT histograms (seconds, as clients see them: from the request's
submission to its first and between its later tokens), requests ended by reason, SLA
violations (a finished request whose TTFT or TPOT exceeds its tenant's SLO for its prompt),
tokens generated; and the serving loop's gauges (`LiveDriver.snapshot`, taken every quarter
second): requests waiting and running, KV blocks used and held, per device the share of time
busy since the start, loans in force and guest replicas.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _LoopGauges:
    """A collector reading the serving loop's latest snapshot at each scrape."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        for key, what in (("waiting", "requests waiting for a first admission or after a preemption"),
                          ("running", "requests holding KV"), ("kv_blocks_used", "KV blocks in use"),
                          ("kv_blocks", "KV blocks of the tenant's replicas")):
            g = GaugeMetricFamily(f"slicesched_{key if key.startswith('kv') else 'requests_' + key}", what,
                                  labels=["tenant"])
            for tenant, v in snap.get("tenants", {}).items():
                g.add_metric([tenant], v[key])
            yield g
        busy = GaugeMetricFamily("slicesched_device_busy_share", "share of the time since the start the device "
                                 "ran slices", labels=["device"])
        for d, v in enumerate(snap.get("device_busy_share", [])):
            busy.add_metric([str(d)], v)
        yield busy
        yield GaugeMetricFamily("slicesched_loans_in_force", "staged shard leases in force (SliceScheduler)",
                                value=snap.get("loans", 0))
        yield GaugeMetricFamily("slicesched_guest_replicas", "overflow replicas on lent devices",
                                value=snap.get("guests", 0))
        for key, what in (("faults", "device workers lost since the start"),
                          ("fault_requests", "requests whose worker died under them (recomputed elsewhere)"),
                          ("devices_down", "devices whose worker is lost and not back yet"),
                          ("fault_resume_s", "slowest fault: seconds until its requests made progress again"),
                          ("fault_recovery_s", "slowest fault: seconds until every request it hit did")):
            yield GaugeMetricFamily(f"slicesched_{key}", what, value=snap.get(key, 0))


class Metrics:
    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("slicesched_ttft_seconds", "time to first token", ["tenant"], buckets=BUCKETS_S,
                              registry=r)
        self.tpot = Histogram("slicesched_tpot_seconds", "mean time per output token after the first", ["tenant"],
                              buckets=BUCKETS_S, registry=r)
        self.requests = Counter("slicesched_requests", "requests ended, by reason (length, stop, cancelled, "
                                "error, shutdown)", ["tenant", "reason"], registry=r)
        self.violations = Counter("slicesched_sla_violations", "finished requests beyond their SLO", ["tenant"],
                                  registry=r)
        self.tokens = Counter("slicesched_generated_tokens", "output tokens delivered", ["tenant"], registry=r)
        self.prompt_tokens = Counter("slicesched_prompt_tokens", "prompt tokens of requests ended", ["tenant"],
                                     registry=r)
        r.register(_LoopGauges(snapshot))

    def ended(self, tenant: str, reason: str, prompt: int, generated: int, ttft: float | None, tpot: float | None,
              violated: bool) -> None:
        self.requests.labels(tenant, reason).inc()
        self.tokens.labels(tenant).inc(generated)
        self.prompt_tokens.labels(tenant).inc(prompt)
        if ttft is not None:
            self.ttft.labels(tenant).observe(ttft)
        if tpot is not None:
            self.tpot.labels(tenant).observe(tpot)
        if violated:
            self.violations.labels(tenant).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
