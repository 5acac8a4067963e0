"""Static placements of a compiled graph's slices: round-robin and contiguous splits over
slice indices (`compile_exported(placement=...)`)."""

from __future__ import annotations

from collections.abc import Sequence


def round_robin(num_slices: int, devices: Sequence[int] | int) -> list[int]:
    """Slice i on devices[i % n]: every dependency crosses devices (a transfer stress test)."""
    devs = list(range(devices)) if isinstance(devices, int) else list(devices)
    return [devs[i % len(devs)] for i in range(num_slices)]


def contiguous(num_slices: int, devices: Sequence[int] | int) -> list[int]:
    """Consecutive runs of slices per device (layers split across devices, pipeline style)."""
    devs = list(range(devices)) if isinstance(devices, int) else list(devices)
    return [devs[i * len(devs) // max(num_slices, 1)] for i in range(num_slices)]


PLACEMENTS = {"round_robin": round_robin, "contiguous": contiguous,
              "single": lambda n, devices: [0 if isinstance(devices, int) else list(devices)[0]] * n}
