"""Scenario files: cluster, tenants (model, container, SLA, batching) and workload, in TOML.

Validated at load by pydantic models with one class per area and help text per field; any
mistake becomes one `InputError` line naming the file, the line and the field, e.g.
``scenarios/x.toml:12: field 'tenants[0].modle': unknown field``.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal, Union

import numpy as np
from pydantic import Field, ValidationError, model_validator

from slicesched.config.fields import (MAX_CV, MAX_DURATION_S, MAX_RATE, MAX_RATE_SCALE, MAX_SEQS,  # noqa: F401
                                      MAX_TOKENS, DeviceName, FieldProblem, LinkName, RateScale,
                                      file_name)  # file_name and the bounds: re-exported, read from here by others
from slicesched.config.fields import Strict as _Strict
from slicesched.config.settings import PlanConfig, SchedulersConfig
from slicesched.errors import InputError
from slicesched.hardware.cluster import Cluster, NodeSpec
from slicesched.hardware.specs import DEVICES, LINKS
from slicesched.models.spec import ModelSpec  # noqa: F401 - the type TenantConfig.spec returns


class NodeGroup(_Strict):
    """Servers of one kind in a mixed fleet (`[[cluster.node_groups]]`)."""

    name: str = Field(min_length=1, max_length=64, description="group name, unique; tenants name it in node_group")
    device: DeviceName = Field(description=f"device type, one of {', '.join(DEVICES)}")
    nodes: int = Field(1, ge=1, le=4096, description="number of servers")
    devices_per_node: int = Field(8, ge=1, le=64, description="devices in each server")
    intra_link: LinkName = Field("nvlink4", description=f"link inside a server, one of {', '.join(LINKS)}")
    network: LinkName | None = Field(None, description="each device's network to other servers (its NIC); between "
                                     "two groups a transfer moves at the slower of the two; default: the cluster's "
                                     "inter_link")


SINGLE_KIND = ("device", "nodes", "devices_per_node", "intra_link")


class ClusterConfig(_Strict):
    device: DeviceName = Field("H100-80GB", description=f"device type, one of {', '.join(DEVICES)}")
    nodes: int = Field(1, ge=1, le=4096, description="number of servers")
    devices_per_node: int = Field(8, ge=1, le=64, description="devices in each server")
    intra_link: LinkName = Field("nvlink4", description=f"link inside a server, one of {', '.join(LINKS)}")
    inter_link: LinkName = Field("ib-ndr", description="network between servers")
    profile: str | None = Field(None, description="measured op profile to calibrate the cost model on (a "
                                "profile file, a folder in Vidur's layout, or 'shared:profiles/vidur'); "
                                "default: the roofline model")
    node_groups: tuple[NodeGroup, ...] = Field((), description="a mixed fleet: groups of servers, each of one "
                                               "device type (instead of device, nodes, devices_per_node, intra_link)")

    @model_validator(mode="after")
    def _one_way_to_say_it(self) -> "ClusterConfig":
        if self.node_groups:
            both = [f for f in SINGLE_KIND if f in self.model_fields_set]
            if both:
                raise ValueError(f"give node_groups or {', '.join(both)}, not both")
            names = [g.name for g in self.node_groups]
            if len(set(names)) != len(names):
                raise ValueError(f"node group names must be unique, got {names}")
        return self

    def groups(self) -> tuple[NodeGroup, ...]:
        """The fleet as node groups (one, named 'default', for a single-kind cluster)."""
        if self.node_groups:
            return self.node_groups
        return (NodeGroup(name="default", device=self.device, nodes=self.nodes,
                          devices_per_node=self.devices_per_node, intra_link=self.intra_link),)

    @property
    def num_devices(self) -> int:
        return sum(g.nodes * g.devices_per_node for g in self.groups())

    def group_devices(self, name: str) -> range:
        """Device ids of one group (groups are numbered in the order they are listed)."""
        start = 0
        for g in self.groups():
            n = g.nodes * g.devices_per_node
            if g.name == name:
                return range(start, start + n)
            start += n
        raise KeyError(name)

    def build(self) -> Cluster:
        """The cluster: each group's servers in the order listed, devices numbered across them."""
        nodes = tuple(NodeSpec(g.device, g.devices_per_node, g.intra_link, network=g.network)
                      for g in self.groups() for _ in range(g.nodes))
        return Cluster(nodes, self.inter_link)

    def memory_per_device(self) -> float | np.ndarray:
        """Every device's memory: one figure for a single-kind cluster, each device's own (in
        device order) for a mixed fleet."""
        return self.memory_bytes() if self.node_groups else float(DEVICES[self.device].memory_bytes)

    def memory_bytes(self) -> np.ndarray:
        """Memory of every device, in device order."""
        return np.array([DEVICES[g.device].memory_bytes
                         for g in self.groups() for _ in range(g.nodes * g.devices_per_node)])

    def describe(self) -> str:
        """'8 x H100-80GB' or '8 x H100-80GB + 16 x A100-80GB'."""
        return " + ".join(f"{g.nodes * g.devices_per_node} x {g.device}" for g in self.groups())


class TenantConfig(_Strict):
    name: str = Field(description="tenant name, unique in the scenario")
    model: str = Field(description="shipped model name (e.g. 'llama-3-8b'), a path to a HF config.json, or a "
                       "local checkpoint folder (real serving runs its weights and tokenizer)")
    tp: int = Field(1, ge=1, le=64, description="tensor-parallel degree = devices in one pipeline stage")
    pp: int = Field(1, ge=1, le=64, description="pipeline-parallel stages of one replica, each a tp-way group "
                    "on the next tp devices (a replica has tp x pp devices)")
    replicas: int = Field(1, ge=1, le=64, description="data-parallel replicas (containers) of the model")
    devices: tuple[int, ...] | None = Field(None, description="devices of all replicas (tp x pp x replicas); "
                                            "default: packed in order")
    node_group: str | None = Field(None, description="the node group (cluster.node_groups) its containers "
                                   "are packed on; default: any, in order")
    ttft_slo_s: float | None = Field(None, gt=0, le=MAX_DURATION_S,
                                     description="absolute TTFT SLO; default sla_scale x isolated")
    tpot_slo_s: float | None = Field(None, gt=0, le=MAX_DURATION_S,
                                     description="absolute TPOT SLO; default sla_scale x isolated")
    sla_scale: float = Field(5.0, gt=1, le=1000, description="SLO as a multiple of the isolated single-request latency")
    slo_class: Literal["interactive", "reasoning", "batch"] = Field(
        "interactive", description="what is judged: interactive TTFT and TPOT; reasoning TPOT only; "
        "batch completion within deadline_s of arrival only")
    priority: int = Field(0, ge=0, le=9, description="0-9; schedulers that rank tenants serve a higher one "
                          "first (realloc: which tenant a container goes to)")
    deadline_s: float | None = Field(None, gt=0, le=MAX_DURATION_S,
                                     description="batch: seconds from arrival to the last token")
    attainment: float | None = Field(None, gt=0, le=1, description="share of the tenant's requests that must meet "
                                     "its SLOs (0.99: its latencies within target at the 99th percentile); a "
                                     "capacity search then also requires it of this tenant; default: only the "
                                     "run-wide bound on all requests")
    max_num_seqs: int = Field(256, ge=1, le=MAX_SEQS, description="most sequences in one batch (vLLM max_num_seqs)")
    max_batch_tokens: int = Field(8192, ge=16, le=MAX_TOKENS, description="token budget of one iteration")
    chunked_prefill: bool = Field(True, description="Sarathi-style chunked prefill within the token budget")
    expert_parallel: bool = Field(False, description="MoE: experts split whole over the tp devices (expert "
                                  "parallelism; attention stays tensor-parallel), not each expert cut tp ways")
    expert_routing_skew: float = Field(0.0, ge=0, le=4, description="MoE: expert popularity ~ 1 / rank^skew "
                                       "(Zipf) in the routing model graphs are priced by; 0: uniform")
    data_parallel_attention: bool = Field(False, description="with expert_parallel: each device runs attention "
                                          "(whole attention weights) for its share of the batch's sequences, and "
                                          "tokens reach their experts' devices and come back by all-to-all "
                                          "(DeepEP-style) instead of every device attending to every token")

    def spec(self) -> "ModelSpec":
        """The tenant's model as it is served: its config, with how its experts are served."""
        from dataclasses import replace

        from slicesched.models.spec import model_spec

        m = model_spec(self.model)
        if not m.num_experts:
            return m
        return replace(m, expert_parallel=self.expert_parallel, routing_skew=self.expert_routing_skew,
                       dp_attention=self.data_parallel_attention)

    @model_validator(mode="after")
    def _dp_attention_needs_ep(self) -> "TenantConfig":
        if self.data_parallel_attention and not self.expert_parallel:
            raise ValueError("data_parallel_attention needs expert_parallel = true")
        return self

    @model_validator(mode="after")
    def _batch_has_a_deadline(self) -> "TenantConfig":
        if (self.slo_class == "batch") != (self.deadline_s is not None):
            raise ValueError("slo_class = 'batch' needs deadline_s, and only a batch tenant has one")
        return self

    @model_validator(mode="after")
    def _devices_match_tp(self) -> "TenantConfig":
        if self.devices is not None and len(self.devices) != self.tp * self.pp * self.replicas:
            raise ValueError(f"'devices' lists {len(self.devices)} devices but tp x pp x replicas = "
                             f"{self.tp * self.pp * self.replicas}")
        return self

    @property
    def replica_devices(self) -> int:
        """Devices of one replica: pp stages of tp devices."""
        return self.tp * self.pp


class DiurnalCurve(_Strict):
    """The day's swing: rate x (1 + amplitude sin(2 pi (t - phase_s) / period_s))."""

    kind: Literal["diurnal"]
    period_s: float = Field(86_400.0, gt=0, le=MAX_DURATION_S, description="seconds of one cycle")
    amplitude: float = Field(0.5, ge=0, lt=1, description="swing around the mean, a share of it (0 to < 1)")
    phase_s: float = Field(0.0, ge=-MAX_DURATION_S, le=MAX_DURATION_S, description="seconds the sine is shifted by")


class FlashCurve(_Strict):
    """A flash crowd: from `at_s` the rate rises linearly to `height` x over `rise_s`, then decays
    exponentially with time constant `decay_s`."""

    kind: Literal["flash"]
    at_s: float = Field(ge=0, le=MAX_DURATION_S, description="seconds into the replay when the surge starts")
    height: float = Field(gt=0, le=1000, description="peak rate over the stream's own (e.g. 5: five times)")
    rise_s: float = Field(0.0, ge=0, le=MAX_DURATION_S, description="seconds to the peak")
    decay_s: float = Field(60.0, gt=0, le=MAX_DURATION_S, description="seconds for the surge to fall by 1/e")


class PointsCurve(_Strict):
    """Multipliers at times: `steps` holds each until the next time, `ramp` interpolates linearly;
    the first holds before the first time and the last after the last."""

    kind: Literal["steps", "ramp"]
    times_s: tuple[float, ...] = Field(min_length=1, description="seconds into the replay, increasing")
    multipliers: tuple[float, ...] = Field(min_length=1, description="rate multipliers (> 0), one per time")

    @model_validator(mode="after")
    def _points(self) -> "PointsCurve":
        if len(self.times_s) != len(self.multipliers):
            raise ValueError(f"{len(self.times_s)} times but {len(self.multipliers)} multipliers")
        if any(not (0 <= t <= MAX_DURATION_S) for t in self.times_s) or any(
                b <= a for a, b in zip(self.times_s, self.times_s[1:])):
            raise ValueError(f"times_s must increase, each in [0, {MAX_DURATION_S:g}] seconds")
        if any(not (0 < m <= 1000) for m in self.multipliers):
            raise ValueError("multipliers must be > 0 and <= 1000")
        return self


CurvePart = Annotated[Union[DiurnalCurve, FlashCurve, PointsCurve], Field(discriminator="kind")]
CURVE_FIELD = Field((), description="rate curve over the replay's clock: a product of parts "
                    "(diurnal, flash, steps, ramp); arrivals are time-warped, no request is dropped")


class SyntheticStream(_Strict):
    source: Literal["synthetic"]
    tenants: tuple[str, ...] = Field(description="tenants this stream feeds (split by popularity)")
    rate: float = Field(gt=0, le=MAX_RATE, description="mean requests per second")
    cv: float = Field(1.0, gt=0, le=MAX_CV, description="coefficient of variation of inter-arrival gaps (1 = Poisson)")
    prompt_mean: float = Field(1024.0, gt=0, le=MAX_TOKENS, description="mean prompt length, tokens")
    prompt_sigma: float = Field(1.0, ge=0, le=10, description="log-normal shape of prompt lengths (0: all the mean)")
    output_mean: float = Field(256.0, gt=0, le=MAX_TOKENS, description="mean output length, tokens")
    output_sigma: float = Field(1.0, ge=0, le=10, description="log-normal shape of output lengths (0: all the mean)")
    popularity: Literal["powerlaw", "uniform", "round_robin"] = "powerlaw"
    alpha: float = Field(1.0, ge=0, le=10, description="power-law exponent of tenant popularity")
    system_prompt_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="a system prompt this long, "
                                      "the same for every request of the stream, precedes each drawn prompt "
                                      "(a reuse model for prefix caching: its whole 512-token blocks are shared)")
    turns_mean: float = Field(1.0, ge=1, le=100, description="mean turns per conversation (geometric; a "
                              "reuse model for prefix caching): a follow-up's prompt is the conversation so far "
                              "(every earlier prompt and output) and a new message as long as the first; `rate` "
                              "then counts conversations, each turn going to the first turn's tenant")
    think_s: float = Field(10.0, gt=0, le=MAX_DURATION_S, description="mean seconds between the arrivals of a "
                           "conversation's turns (exponential)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="the clients' max_tokens: "
                                   "longer outputs are cut to it, as an API caps generation")
    curve: tuple[CurvePart, ...] = CURVE_FIELD


class TraceStream(_Strict):
    source: Literal["trace"]
    path: str = Field(description="trace file; 'shared:' prefix resolves to the shared data folder")
    format: str | None = Field(None, description="azure | mooncake | burstgpt | csv (default: sniffed)")
    tenants: tuple[str, ...]
    popularity: Literal["powerlaw", "uniform", "round_robin"] = "powerlaw"
    alpha: float = Field(1.0, ge=0, le=10, description="power-law exponent of tenant popularity")
    start_s: float = Field(0.0, ge=0, le=MAX_DURATION_S, description="window start within the trace")
    tick_s: float = Field(0.0, ge=0, le=MAX_DURATION_S,
                          description="the trace's timestamps are rounded to this clock tick; "
                          "each request is spread uniformly over its tick (seeded; 0: kept as recorded)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="the clients' max_tokens: "
                                   "longer outputs are cut to it, as an API caps generation")
    curve: tuple[CurvePart, ...] = CURVE_FIELD


class ServeGenStream(_Strict):
    source: Literal["servegen"]
    root: str = Field("shared:traces/servegen/data", description="ServeGen data folder")
    category: str = "language"
    model: str = "m-large"
    clients: tuple[int, ...] | None = Field(None, description="client ids; default: the busiest len(tenants)")
    tenants: tuple[str, ...] = Field(description="client i feeds tenant i")
    start_s: float = Field(0.0, ge=0, le=MAX_DURATION_S,
                           description="seconds into the ServeGen day where the window starts")
    rate_scale: float = Field(1.0, gt=0, le=MAX_RATE_SCALE,
                              description="multiply ServeGen rates (production rates are huge)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="the clients' max_tokens: "
                                   "longer outputs are cut to it, as an API caps generation")
    curve: tuple[CurvePart, ...] = CURVE_FIELD


Stream = Annotated[Union[SyntheticStream, TraceStream, ServeGenStream], Field(discriminator="source")]


class ReplayConfig(_Strict):
    schedulers: tuple[str, ...] = Field(("dedicated", "temporal-mux", "realloc"), description="schedulers to compare")
    duration_s: float = Field(60.0, gt=0, le=MAX_DURATION_S, description="simulated seconds of arrivals to replay")
    rate_scales: tuple[RateScale, ...] = Field((1.0,), min_length=1,
                                               description="time compressions of the workload to run")
    grain: Literal["op", "block", "layer"] = Field("block", description="slice grain")
    perturbation_cv: float = Field(0.05, ge=0, le=1, description="seeded variation of real op durations")
    drain_s: float = Field(120.0, ge=0, le=MAX_DURATION_S,
                           description="extra simulated time to finish in-flight requests")
    gpu_memory_utilization: float = Field(0.9, gt=0.1, le=1.0, description="share of device memory for "
                                          "weights + KV cache (the rest is activation headroom), as in vLLM")
    prefix_caching: bool = Field(False, description="share a tenant's full prompt blocks between its requests "
                                 "as vLLM's automatic prefix caching does, keyed by the trace's prefix hashes "
                                 "(Mooncake's hash_ids); requests without hashes find nothing cached")
    spatial_sharing: bool = Field(False, description="devices run slices of several streams at once "
                                  "(MPS, stream priorities): overlapping slices share SMs and HBM bandwidth, "
                                  "a device's owners before guests (off: one slice at a time per device)")
    over_context: Literal["truncate", "reject"] = Field(
        "truncate", description="a request whose prompt + output exceeds its model's context window: "
        "'truncate' cuts the output (and, if the prompt alone is too long, keeps its last tokens) to "
        "fit, as trace replays (Vidur) do when a trace is mapped onto a shorter-context model; "
        "'reject' refuses it as vLLM's API refuses a max_tokens beyond the window (a violation)")


class Scenario(_Strict):
    name: str = Field("scenario", min_length=1, max_length=200,
                      description="scenario name (output folders use `file_name` of it)")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of every random draw (workload, noise), >= 0")
    cluster: ClusterConfig = ClusterConfig()
    tenants: tuple[TenantConfig, ...] = Field(min_length=1)
    streams: tuple[Stream, ...] = Field(min_length=1)
    replay: ReplayConfig = ReplayConfig()
    schedulers: SchedulersConfig = SchedulersConfig()
    plan: PlanConfig = PlanConfig()
    source_path: str | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        for s in self.streams:
            unknown = [t for t in s.tenants if t not in names]
            if unknown:
                raise ValueError(f"stream feeds unknown tenant(s) {unknown}; tenants are {names}")
        n = self.cluster.num_devices
        groups = [g.name for g in self.cluster.groups()]
        for i, t in enumerate(self.tenants):
            if t.node_group is not None and t.node_group not in groups:
                raise FieldProblem(("tenants", i, "node_group"),
                                   f"unknown node group '{t.node_group}'; the cluster has {', '.join(groups)}")
            if t.node_group is not None and t.devices is not None:
                raise FieldProblem(("tenants", i, "node_group"), "give devices or node_group, not both")
            if t.replica_devices > n:
                raise FieldProblem(("tenants", i, "pp" if t.pp > 1 else "tp"),
                                   f"a replica of tp={t.tp} x pp={t.pp} needs {t.replica_devices} devices, "
                                   f"the cluster has {n}")
        used = [d for t in self.tenants for d in (t.devices or ())]
        if any(d < 0 or d >= n for d in used):
            raise ValueError(f"a tenant's devices fall outside the cluster's 0..{n - 1}")
        need = sum(t.replica_devices * t.replicas for t in self.tenants)
        if need > n:
            raise ValueError(f"tenants need {need} devices, the cluster has {n}")
        if len(used) != len(set(used)):
            raise ValueError("two tenants list the same device; co-location is a scheduler's choice")
        return self

    def resolve_path(self, p: str) -> Path:
        """A path from the scenario: 'shared:' is the shared data folder, others are relative to the file."""
        if p.startswith("shared:"):
            return shared_dir(Path(self.source_path).parent if self.source_path else Path.cwd()) / p[7:]
        base = Path(self.source_path).parent if self.source_path else Path.cwd()
        return (base / p).resolve()


def shared_dir(start: Path | None = None) -> Path:
    """The shared data folder: $SLICESCHED_SHARED, else the nearest ancestor's `shared/` with traces."""
    env = os.environ.get("SLICESCHED_SHARED")
    if env:
        return Path(env)
    for d in [*(start or Path.cwd()).resolve().parents, (start or Path.cwd()).resolve()]:
        for cand in (d / "shared", d.parent / "shared"):
            if (cand / "traces").is_dir():
                return cand
    return Path(__file__).resolve().parents[4].parent / "shared"


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario TOML file; every mistake is one InputError line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("scenario file not found", file=str(p)) from None
    except IsADirectoryError:
        raise InputError("is a folder, not a scenario file", file=str(p)) from None
    except UnicodeDecodeError as e:
        line = text_line(e.object, e.start)
        raise InputError(f"not a text (UTF-8) file: byte 0x{e.object[e.start]:02x} cannot be decoded",
                         file=str(p), line=line) from None
    except OSError as e:
        raise InputError(f"cannot read the scenario file: {e.strerror}", file=str(p)) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = getattr(e, "lineno", None) or _line_from_msg(str(e))
        raise InputError(f"invalid TOML: {str(e).split(' (at')[0]}", file=str(p), line=line) from None
    return parse_scenario(raw, source=str(p), text=text)


def parse_scenario(raw: dict, source: str = "<scenario>", text: str = "") -> Scenario:
    try:
        return Scenario.model_validate({**raw, "source_path": source if source != "<scenario>" else None})
    except ValidationError as e:
        errs = e.errors()
        # A misspelled key also makes its real name "missing": report the misspelling.
        err = next((x for x in errs if x["type"] == "extra_forbidden"), errs[0])
        field = _dotted(err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field" + _suggest(err["loc"], errs)
        if err["type"] == "union_tag_invalid" or err["type"] == "union_tag_not_found":
            msg = "'source' must be one of synthetic, trace, servegen"
        msg = msg.removeprefix("Value error, ")
        blamed = (err.get("ctx") or {}).get("error")
        if isinstance(blamed, FieldProblem):
            raise InputError(msg, file=source, line=_line_of(text, blamed.loc), field=_dotted(blamed.loc)) from None
        if field == "<root>":  # a whole-scenario check: no single field to name
            raise InputError(msg, file=source) from None
        if err["type"] == "missing":  # nothing in the file to point at
            what = f"a [[{field}]] table" if field in ("tenants", "streams") else "this field"
            raise InputError(f"missing: the scenario needs {what}", file=source, field=field) from None
        raise InputError(msg, file=source, line=_line_of(text, err["loc"]), field=field) from None


def text_line(data: bytes, offset: int) -> int:
    """1-based line of byte `offset` in `data`."""
    return data.count(b"\n", 0, offset) + 1


def scenario_error(sc: Scenario, loc: tuple, message: str) -> InputError:
    """An InputError about field `loc` (pydantic-style, e.g. ("tenants", 0, "tp")) of a loaded
    scenario, with the file and the field's line when the scenario came from a file."""
    text = ""
    if sc.source_path:
        try:
            text = Path(sc.source_path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            pass
    return InputError(message, file=sc.source_path, line=_line_of(text, loc) if text else None,
                      field=_dotted(loc))


def _suggest(loc: tuple, errs: list) -> str:
    missing = [x["loc"][-1] for x in errs if x["type"] == "missing" and x["loc"][:-1] == loc[:-1]]
    close = difflib.get_close_matches(str(loc[-1]), [str(m) for m in missing], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("synthetic", "trace", "servegen") and out:
            continue  # discriminator tag pydantic inserts into the location
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _line_of(text: str, loc: tuple) -> int | None:
    """Best-effort line of the offending key: the n-th table of an array, then the key in it."""
    lines = text.splitlines()
    start, table_key = 0, None
    if loc and isinstance(loc[0], str) and len(loc) > 1 and isinstance(loc[1], int):
        table_key, idx = loc[0], loc[1]
        hits = [i for i, line in enumerate(lines) if re.match(rf"\s*\[\[\s*{re.escape(table_key)}\s*\]\]", line)]
        if idx < len(hits):
            start = hits[idx]
    elif loc and isinstance(loc[0], str) and len(loc) > 1:  # a key of a plain table, e.g. [cluster]
        hits = [i for i, line in enumerate(lines) if re.match(rf"\s*\[\s*{re.escape(loc[0])}\s*\]", line)]
        if hits:
            table_key, start = loc[0], hits[0]
    keys = [k for k in loc if isinstance(k, str) and k != table_key]
    for key in reversed(keys):
        for i in range(start, len(lines)):
            if re.match(rf"\s*{re.escape(key)}\s*=", lines[i]) or re.search(rf"[{{,]\s*{re.escape(key)}\s*=", lines[i]):
                return i + 1
    return start + 1 if table_key else None


def _line_from_msg(msg: str) -> int | None:
    m = re.search(r"line (\d+)", msg)
    return int(m.group(1)) if m else None
