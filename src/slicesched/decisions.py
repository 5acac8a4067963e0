"""The values that pass between schedulers and backends: decisions, their outcomes, loads.

Frozen, slotted dataclasses with no dependency on any other package, so that the simulator,
the executor, the replay driver and the schedulers all import them from here (layers point
down: nothing below `sched/` needs to import it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlicePlacement:
    """Run slices first_slice .. first_slice+num_slices-1 (global GMG ids) on device group `group`.

    A run of consecutive slices shares one placement so that the common case (a whole
    iteration on its own container) is one object, not hundreds.
    """

    first_slice: int
    group: int
    num_slices: int = 1

    def slice_ids(self) -> range:
        return range(self.first_slice, self.first_slice + self.num_slices)


@dataclass(frozen=True, slots=True)
class WeightCopy:
    """Make `tenant`'s weight block resident on `dst_device`, copied from `src_device`
    (-1: from host memory over PCIe). With `degree` > 1, only the shard of rank `rank` of a
    tensor-parallel group of `degree` devices (its `nbytes`): what a backend that computes
    needs to cut the block, and what one that prices it ignores."""

    tenant: str
    block: int
    src_device: int
    dst_device: int
    nbytes: float = 0.0  # bytes to copy (a shard for a wider tensor-parallel group); 0: the source's block
    rank: int = 0
    degree: int = 1


@dataclass(frozen=True, slots=True)
class WeightEviction:
    tenant: str
    block: int
    device: int


@dataclass(frozen=True, slots=True)
class TenantDemand:
    """An operator's load forecast for one tenant, known before the run (MuxServe plans its
    placement from such known arrival rates): mean requests per second and mean prompt and
    output tokens per request. Never the requests themselves."""

    rate_rps: float
    mean_prompt: float
    mean_output: float


@dataclass(frozen=True, slots=True)
class Provisioning:
    """How the replicas of a deployment start (`Scheduler.provisioning`): the indices of those
    whose weights are not loaded (`cold`: the scheduler loads them when it needs them, within what
    the warm replicas' weights take, which alone count against the KV memory), and each replica's
    weight in splitting a device's KV memory among the replicas on it (`kv_weights`; None: equal
    weights, so that co-located replicas get similar token capacity)."""

    cold: frozenset[int] = frozenset()
    kv_weights: tuple[float, ...] | None = None
    # (tenant, device, share of the device's SMs) where the backend shares devices spatially
    # (an MPS active-thread percentage): the tenant's kernels there use at most that share
    sm_shares: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerMove:
    """Container-granularity reallocation: the replica of `from_tenant` on `devices` drains
    (its queued requests go to the tenant's other replicas at once, running ones finish), then
    `to_tenant`'s weights are loaded there and it serves as a new replica (tensor-parallel over
    `devices`). The driver carries it out and pays its costs (drain, weight load, warm-up). A
    tenant's last replica may move (scale to zero): its later arrivals wait for a replica."""

    devices: tuple[int, ...]
    from_tenant: str
    to_tenant: str


@dataclass(frozen=True, slots=True)
class GuestStart:
    """Serve overflow of `tenant` on `devices` of other containers: copy its weight shards there
    from host memory (over each device's PCIe link, sparing the home replica's links) and give it
    `kv_bytes` per device of KV cache lent by the devices' owners. Its slices then run only where
    the scheduler places them (in the owners' idle slices). `max_batch_tokens`: its iterations'
    token budget where smaller than the tenant's (None: the tenant's): beside busy owners, each of
    its slices stays short enough for the owners' next iterations to wait for. `prefill_only`:
    it serves prompts only, each request moving home with its KV cache once its first token is
    out (disaggregated prefill), so the owners' devices never carry its memory-bound decodes."""

    tenant: str
    devices: tuple[int, ...]
    kv_bytes: float
    max_batch_tokens: int | None = None
    prefill_only: bool = False

    def weight_copies(self, num_blocks: int) -> tuple[WeightCopy, ...]:
        return tuple(WeightCopy(self.tenant, blk, -1, dst) for dst in self.devices for blk in range(num_blocks))


@dataclass(frozen=True, slots=True)
class GuestStop:
    """End the guest of `tenant` on `devices`. With `drain`, it takes no new requests and is
    released once its running ones finish; without, its requests move back to the tenant's own
    replicas at once (running ones with their KV cache where a replica has room, the rest
    recomputed). Then its KV and weights are freed and the lent memory returns."""

    tenant: str
    devices: tuple[int, ...]
    drain: bool = False


@dataclass(frozen=True, slots=True)
class ShardStage:
    """Stage `tenant`'s weight shards on `devices` of other containers, ahead of need, so that its
    slices may later run tensor-parallel over its home `home` plus these devices (the union).
    Block `blocks[j]` is copied as `shard_bytes[j]` bytes (its shard at the union's degree) from
    `src_devices[i]` (a home device) to `devices[i]`. The driver lends the memory from the
    devices' owners' free KV blocks, all or nothing, and refuses the stage if it cannot."""

    tenant: str
    home: tuple[int, ...]
    devices: tuple[int, ...]
    src_devices: tuple[int, ...]
    blocks: tuple[int, ...]
    shard_bytes: tuple[float, ...]
    kv_mirror_bytes: float = 0.0  # per device: room for a copy of the tenant's KV heads of this shard

    @property
    def bytes_per_device(self) -> float:
        """Weight bytes staged on each device."""
        return float(sum(self.shard_bytes))

    @property
    def lent_bytes(self) -> float:
        """Memory the owners lend per device: the shards plus the KV mirror."""
        return self.bytes_per_device + self.kv_mirror_bytes

    def weight_copies(self) -> tuple[WeightCopy, ...]:
        """The shards, device i of `devices` holding rank len(home) + i of the union."""
        degree = len(self.home) + len(self.devices)
        return tuple(WeightCopy(self.tenant, b, src, dst, nb, len(self.home) + i, degree)
                     for i, (src, dst) in enumerate(zip(self.src_devices, self.devices))
                     for b, nb in zip(self.blocks, self.shard_bytes))


@dataclass(frozen=True, slots=True)
class ShardRelease:
    """Evict the shards staged for `tenant` on `devices` and give the memory back to its owners.
    The scheduler issues it only when no live slice of the tenant is mapped onto those devices."""

    tenant: str
    devices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardLease:
    """Shards a driver holds staged: `tenant` (home `home`) on borrowed `devices`, with
    `lent_bytes` per device lent by their owners; `kv_mirror_bytes` of them hold a copy of the
    tenant's KV heads of this shard (`kv_mirror_used` in use), which lets whole iterations run
    tensor-parallel over the union while it has room."""

    tenant: str
    home: tuple[int, ...]
    devices: tuple[int, ...]
    blocks: tuple[int, ...]
    lent_bytes: float
    kv_mirror_bytes: float = 0.0
    kv_mirror_used: float = 0.0


@dataclass(frozen=True, slots=True)
class SchedulerDecision:
    """Everything a scheduler decided at one instant; backends must not modify it."""

    time: float
    placements: tuple[SlicePlacement, ...] = ()
    weight_copies: tuple[WeightCopy, ...] = ()
    evictions: tuple[WeightEviction, ...] = ()
    container_moves: tuple[ContainerMove, ...] = ()
    guest_starts: tuple[GuestStart, ...] = ()
    guest_stops: tuple[GuestStop, ...] = ()
    shard_stages: tuple[ShardStage, ...] = ()
    shard_releases: tuple[ShardRelease, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.placements or self.weight_copies or self.evictions or self.container_moves
                    or self.guest_starts or self.guest_stops or self.shard_stages or self.shard_releases)


@dataclass(frozen=True, slots=True)
class SliceCompletion:
    slice_id: int
    group: int
    start: float
    end: float


class Completions(Sequence[SliceCompletion]):
    """Completed slices in (end, slice id) order, made into `SliceCompletion`s on first read.

    A backend reports a chain of slices run back to back as (first id, group, starts, ends)
    and single slices as (id, group, start, end) tuples; a replay driver mostly asks only
    whether anything completed, so building hundreds of objects per iteration up front would be
    most of its cost. Compares equal to any sequence with the same completions (e.g. `()`).
    """

    __slots__ = ("_singles", "_chains", "_items", "_n")

    def __init__(self, singles: Sequence[tuple[int, int, float, float]] = (),
                 chains: Sequence[tuple[int, int, "object", "object"]] = ()) -> None:
        self._singles, self._chains = singles, chains
        self._items: tuple[SliceCompletion, ...] | None = None
        self._n = len(singles) + sum(len(c[2]) for c in chains)  # type: ignore[arg-type]

    def _all(self) -> tuple[SliceCompletion, ...]:
        if self._items is None:
            items = [SliceCompletion(*x) for x in self._singles]
            for first, group, starts, ends in self._chains:
                items += [SliceCompletion(first + i, group, s, e)
                          for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist()))]  # type: ignore[attr-defined]
            if len(items) > 1:
                items.sort(key=lambda c: (c.end, c.slice_id))
            self._items, self._singles, self._chains = tuple(items), (), ()
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        return self._all()[i]

    def __iter__(self) -> Iterator[SliceCompletion]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == self._n and tuple(other) == self._all()

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"Completions({list(self._all())!r})"


@dataclass(frozen=True, slots=True)
class OOMEvent:
    """An allocation that would have exceeded a device's capacity; never clipped away."""

    device: int
    time: float
    requested_bytes: float
    in_use_bytes: float
    capacity_bytes: float
    what: str  # "weights" | "kv" | "activation" | "transfer"
    tenant: str


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a backend reports after running (part of) decisions, up to `time`."""

    time: float
    completed: Sequence[SliceCompletion] = ()  # a tuple or `Completions`
    finished_iterations: tuple[int, ...] = ()  # GMG iteration keys whose every slice is done
    ooms: tuple[OOMEvent, ...] = ()
    # per finished iteration computed by a backend that runs real models: (key, the greedy next
    # token of every batch entry, in batch order); empty from the simulator
    tokens: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # devices whose worker process died since the last outcome (what they held is gone), and
    # devices whose worker is back (a new process, holding nothing); empty from the simulator
    lost_devices: tuple[int, ...] = ()
    back_devices: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What a backend that runs real models needs of one iteration beyond its op graph: per
    batch entry, the token ids it feeds (`context_lens_before[i]` tokens before them are in the
    KV cache) and the ids of the KV blocks that hold its sequence, in the pool of the replica
    (`pool`: tenant and home group; `num_blocks` of `block_tokens` tokens)."""

    pool: tuple[str, int]
    num_blocks: int
    block_tokens: int
    token_ids: tuple[tuple[int, ...], ...]
    context_lens_before: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    tenant: str
    devices: tuple[int, ...]
    waiting: int
    running: int
    draining: bool
    group: int = -1  # device-group id (the home of its iterations in the GMG)
    guest: bool = False  # a guest on other tenants' devices (SliceScheduler overflow)
    kv_used_frac: float = 0.0
    kv_free_bytes: float = 0.0  # per device, unused KV pool (what could be lent)
