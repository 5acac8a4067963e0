"""Per-scheduler settings (`[schedulers.<name>]`) and the planner's (`[plan]`): one default for
every scenario, which a scenario may override."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from slicesched.config.fields import LENDER_KV_KEPT, MAX_DURATION_S, MAX_SEQS, DeviceName
from slicesched.config.fields import Strict as _Strict

class ReallocConfig(_Strict):
    """The `realloc` autoscaler (`[schedulers.realloc]`): one default for every scenario,
    chosen as an operator of a request-driven LLM autoscaler would (Knative / KServe style)."""

    interval_s: float = Field(2.0, gt=0, le=MAX_DURATION_S,
                              description="how often the autoscaler reads its metrics and may "
                              "start one move (Knative's autoscaler ticks every 2 s)")
    scale_up_concurrency: float = Field(16.0, gt=0, le=1e6, description="queued + running requests per active "
                                        "replica at which a tenant wants another replica (Knative's "
                                        "concurrency target; vLLM's num_requests_waiting + _running)")
    scale_up_kv_frac: float = Field(0.9, gt=0, le=1, description="KV-cache use of a replica at which its "
                                    "tenant wants another replica (vLLM's gpu_cache_usage_perc)")
    scale_up_checks: int = Field(1, ge=1, le=1000, description="consecutive checks over a scale-up threshold before "
                                 "acting (1: at once, as Knative's panic mode; a move takes seconds, and the "
                                 "donor rule, the hysteresis and the cooldown keep it from flapping)")
    donor_window_s: float = Field(2.0, ge=0, le=MAX_DURATION_S,
                                  description="a tenant gives up a replica only after this long "
                                  "without queued requests and with its load, spread over one replica fewer, "
                                  "under donor_concurrency and donor_kv_frac (scale-down stabilization: two "
                                  "consecutive checks)")
    donor_concurrency: float = Field(4.0, gt=0, le=1e6, description="running requests per remaining replica a donor "
                                     "may reach (a quarter of the scale-up target: hysteresis)")
    donor_kv_frac: float = Field(0.5, gt=0, le=1, description="KV use the donor's remaining replicas may reach")
    idle_to_zero_s: float = Field(30.0, ge=0, le=MAX_DURATION_S,
                                  description="a tenant's last replica may go (scale to zero, as "
                                  "serverless LLM serving does) after this long with no request at all; its "
                                  "next request waits for a cold start")
    cooldown_s: float = Field(10.0, ge=0, le=MAX_DURATION_S,
                              description="after a move, the tenant that took the container "
                              "takes part in no other for this long (the donor must drain, the weights "
                              "load and the engine warm up before the new replica shows its effect)")
    warmup_s: float = Field(2.0, ge=0, le=MAX_DURATION_S,
                            description="engine start-up after the weights land: process and "
                            "CUDA context kept warm, KV pool allocation and CUDA-graph capture")
    min_kv_frac: float = Field(0.2, ge=0, lt=1, description="a container takes a model only if its weights "
                               "leave this share of usable memory for KV cache")


class AegaeonConfig(_Strict):
    """The `aegaeon` baseline (`[schedulers.aegaeon]`): token-level model switching on pooled
    instances. Every cost a switch pays is named here or comes from the cluster: the weights load
    from a host-memory cache of every model over each device's own host link (PCIe: the node's
    `host_link`), the KV cache of a switched-out model stays in device memory (nothing moved),
    and the engine is reused (Aegaeon's component reuse: no re-initialisation cost, counted as
    zero, in the baseline's favour)."""

    weight_slots: int = Field(2, ge=1, le=64, description="models whose weights an instance keeps resident at "
                              "once (2: the active model and the next one, prefetched); fewer where they would "
                              "leave less than min_kv_frac for KV cache")
    prefetch: bool = Field(True, description="load the next model of the decode round while the current one runs, "
                           "where a slot is free (Aegaeon's weight prefetch)")
    tpot_headroom: float = Field(0.9, gt=0, le=1, description="share of each model's TPOT SLO one decode round "
                                 "(every model's turn plus the switches between them) may take; it sizes the "
                                 "weighted round-robin quotas")
    min_kv_frac: float = Field(0.2, ge=0, lt=1, description="an instance's weight area leaves this share of usable "
                               "memory for the KV cache of every model it serves")
    max_group_size: int = Field(8, ge=1, le=MAX_SEQS, description="waiting requests of one model an arrival may "
                                "join on an instance (grouped first come first served: one switch serves the group)")


class SliceSchedConfig(_Strict):
    """SliceScheduler's settings: one default for every scenario (never tuned to one); a scenario may
    override them in a `[schedulers.slicesched]` table."""

    check_interval_s: float = Field(0.05, gt=0, le=MAX_DURATION_S,
                                    description="simulated seconds between lease (shard staging and "
                                    "release) decisions; slice placement runs at every call")
    horizon_s: float = Field(0.5, gt=0, le=MAX_DURATION_S,
                             description="at most this far a what-if fork runs ahead to see an "
                           "iteration end (else twice the iteration's cost-model duration)")
    stage_horizon_s: float = Field(0.05, gt=0, le=MAX_DURATION_S,
                                   description="what-if horizon of the memory check before staging")
    memory_whatifs_per_check: int = Field(4, ge=1, le=1000,
                                          description="at most this many memory what-ifs (shard stages and "
                                          "overflow replicas) in one lease check; later candidates wait for the "
                                          "next check, so one decision's work stays bounded")
    lender_slack_frac: float = Field(0.1, ge=0, le=100, description="a lender's iteration may be delayed by borrowed "
                                     "slices by at most this share of its TPOT SLO (predicted by a what-if)")
    guest_slice_frac: float = Field(0.25, gt=0, le=100, description="beside a lender with work of its own, each "
                                    "slice of an overflow replica takes at most this share of the lender's decode "
                                    "step alone (its slices go first, so each of its iterations waits for at most one)")
    guest_prefill_only: bool = Field(True, description="on spatially shared devices an overflow replica serves "
                                     "prompts only: each request decodes at home once its first token is out, its KV "
                                     "sent over the link, so a lender's device never runs the guest's memory-bound "
                                     "decodes at low priority beside its owner's work")
    min_gain_frac: float = Field(0.02, ge=0, le=100, description="borrow devices for an iteration only if the what-if "
                                 "predicts it ends at least this share of its home duration sooner")
    whatif_reuse_s: float = Field(0.25, ge=0, le=MAX_DURATION_S,
                                  description="with no lender work live, a what-if verdict is "
                                  "reused this long for iterations of the same shape class (0: simulate every one)")
    min_idle_share: float = Field(0.5, ge=0, le=1, description="a lender's devices must have been idle this "
                                  "share of the last idle_window_s")
    idle_window_s: float = Field(1.0, gt=0, le=MAX_DURATION_S,
                                 description="window of the idle history that ranks lenders")
    lender_history_s: float = Field(10.0, gt=0, le=MAX_DURATION_S,
                                    description="a lease's lender devices must also have been idle "
                                    "min_idle_share of this longer window (a busy tenant's lull does not lend)")
    forecast_weight: float = Field(0.05, gt=0, le=1, description="weight of each check's load in a tenant's "
                                   "load forecast (exponential average of requests per replica)")
    borrower_share: float = Field(0.5, ge=0, le=1, description="only tenants whose load forecast is at least "
                                  "this share of the hottest tenant's borrow; leases of others are released")
    lender_forecast_frac: float = Field(0.25, ge=0, le=100,
                                        description="a tenant lends only if its load forecast is at "
                                        "most this share of the borrower's")
    lender_max_load: int = Field(0, ge=0, le=1_000_000,
                                 description="a replica lends devices only with at most this many "
                                 "requests of its own")
    lend_frac: float = Field(0.7, gt=0, le=1 - LENDER_KV_KEPT, description="at most this share of a lender's free "
                             "KV pool holds staged shards and overflow replicas (at most 0.75: a lender always "
                             "keeps a quarter of its pool)")
    kv_headroom: float = Field(2.0, ge=0, le=100, description="a lender keeps this many times its peak KV use (over "
                               "kv_peak_window_s) before lending any of its free pool")
    kv_peak_window_s: float = Field(10.0, gt=0, le=MAX_DURATION_S, description="window of a lender's KV use history")
    reclaim_kv_frac: float = Field(0.7, gt=0, le=1, description="shards are released when their lender's "
                                   "KV pool is this full")
    reclaim_forecast_frac: float = Field(0.5, ge=0, le=100,
                                         description="shards are released when a lender's load forecast "
                                         "passes this share of the borrower's (its load is back)")
    guest_min_forecast: float = Field(1.0, ge=0, le=1e6,
                                      description="a hot tenant gets an overflow replica on calm devices "
                                      "only while its load forecast is at least this many requests per replica")
    lending_layout: bool = Field(True, description="where the scenario gives no tenant's devices, lay the containers "
                                 "out so each node mixes hot and calm ones (by the load forecast): a lease stays "
                                 "inside a node, so hot replicas packed together have nothing to borrow")
    calm_release_s: float = Field(2.0, gt=0, le=MAX_DURATION_S,
                                  description="shards are released after the tenant's home replica "
                                  "has had no request for this long")


PRICE_PER_GPU_HOUR = {"H100-80GB": 3.00, "H200-141GB": 3.80, "A100-80GB": 1.80, "A100-40GB": 1.30, "L40S": 1.00,
                      "A40": 0.60, "cpu": 0.0}
"""Default USD per GPU-hour of each device type: round figures of 2025 on-demand list prices at
GPU clouds (hyperscalers charge more, reservations less); a scenario sets its own in `[plan]`."""


class PlanConfig(_Strict):
    """`slicesched plan` (`[plan]`): what a GPU costs and how far the search may go."""

    price_per_gpu_hour: dict[DeviceName, Annotated[float, Field(ge=0, le=1000)]] = Field(
        default_factory=dict, description="USD per GPU-hour by device type (0-1000), over the defaults "
        "(PRICE_PER_GPU_HOUR: H100-80GB 3.00, H200-141GB 3.80, A100-80GB 1.80, A100-40GB 1.30, L40S 1.00, A40 0.60)")
    max_gpus: int = Field(256, ge=1, le=4096, description="the largest fleet (GPUs) the planner tries")
    layouts_per_size: int = Field(4, ge=1, le=64, description="candidate layouts replayed at each fleet size "
                                  "(the one closest to the forecast's work shares first)")

    def price(self, device: str) -> float:
        return self.price_per_gpu_hour.get(device, PRICE_PER_GPU_HOUR.get(device, 0.0))


class SchedulersConfig(_Strict):
    """Per-scheduler settings (`[schedulers.<name>]`)."""

    realloc: ReallocConfig = ReallocConfig()
    aegaeon: AegaeonConfig = AegaeonConfig()
    slicesched: SliceSchedConfig = SliceSchedConfig()
