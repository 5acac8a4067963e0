"""Device and link specifications from vendor data sheets.

Peak figures are dense (no structured sparsity) bf16/fp16 tensor-core throughput and HBM
bandwidth as printed by the vendor; achievable fractions live in the cost model, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 1024**3
MB = 1e6
TFLOPS = 1e12


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator type."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # HBM bytes/s
    memory_bytes: int
    launch_overhead_s: float = 2e-6  # fixed cost of the smallest kernel (launch + scheduling gap)
    # streaming multiprocessors: a GEMM's weight matrix is shared out among them, and one whose
    # share per SM is small cannot keep them all busy; 0: unknown (no such bound)
    sm_count: int = 0
    sm_clock_hz: float = 0.0  # boost clock of an SM
    # last-level (L2) cache: an element-wise op whose operands were just written by the kernel
    # before it (or fit beside them) reads them from here, not HBM; 0: none modelled
    l2_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.mem_bandwidth <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"device {self.name}: peak_flops, mem_bandwidth and memory_bytes must be > 0")

    @property
    def sm_cycles_per_s(self) -> float:
        """SMs x boost clock: what bounds kernels that cannot fill HBM (norms, gathers run one
        block per token); 0: unknown (no such bound)."""
        return self.sm_count * self.sm_clock_hz


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A point-to-point path between two devices: per-direction bandwidth and latency."""

    name: str
    bandwidth: float  # bytes/s, one direction
    latency_s: float

    def transfer_time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth if nbytes > 0 else 0.0


# Data sheets: NVIDIA A100 (2020, 40GB/80GB SXM), H100 SXM5 (2022), H200 SXM (2024), L40S (2023),
# A40 (2020); L2 sizes from the architecture whitepapers (GA100 40 MB, GH100 50 MB, AD102 96 MB,
# GA102 6 MB).
DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("A100-40GB", 312 * TFLOPS, 1555 * GB, 40 * GiB, sm_count=108, sm_clock_hz=1.41e9,
                   l2_bytes=40 * MB),
        DeviceSpec("A100-80GB", 312 * TFLOPS, 2039 * GB, 80 * GiB, sm_count=108, sm_clock_hz=1.41e9,
                   l2_bytes=40 * MB),
        DeviceSpec("H100-80GB", 989 * TFLOPS, 3350 * GB, 80 * GiB, sm_count=132, sm_clock_hz=1.98e9,
                   l2_bytes=50 * MB),
        DeviceSpec("H200-141GB", 989 * TFLOPS, 4800 * GB, 141 * GB, sm_count=132, sm_clock_hz=1.98e9,
                   l2_bytes=50 * MB),
        DeviceSpec("L40S", 362 * TFLOPS, 864 * GB, 48 * GB, sm_count=142, sm_clock_hz=2.52e9,
                   l2_bytes=96 * MB),
        DeviceSpec("A40", 149.7 * TFLOPS, 696 * GB, 48 * GB, sm_count=84, sm_clock_hz=1.74e9,
                   l2_bytes=6 * MB),
        # A CPU worker standing in for a device (executor tests): nominal, calibrate before use.
        DeviceSpec("cpu", 1 * TFLOPS, 100 * GB, 64 * GiB, launch_overhead_s=20e-6),
    )
}

# Per-direction bandwidths: NVLink 3 (A100) 600 GB/s and NVLink 4 (H100/H200) 900 GB/s are
# bidirectional totals; PCIe x16 per direction; InfiniBand HDR 200 Gb/s, NDR 400 Gb/s per port.
LINKS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec("nvlink3", 300 * GB, 3e-6),
        LinkSpec("nvlink4", 450 * GB, 3e-6),
        LinkSpec("pcie4", 32 * GB, 5e-6),
        LinkSpec("pcie5", 64 * GB, 5e-6),
        LinkSpec("ib-hdr", 25 * GB, 6e-6),
        LinkSpec("ib-ndr", 50 * GB, 6e-6),
        LinkSpec("eth-100g", 12.5 * GB, 20e-6),
        LinkSpec("local", 1e15, 0.0),  # same device: no transfer
    )
}


def device_spec(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise KeyError(f"unknown device type '{name}'; known: {', '.join(sorted(DEVICES))}") from None


def link_spec(name: str) -> LinkSpec:
    try:
        return LINKS[name]
    except KeyError:
        raise KeyError(f"unknown link type '{name}'; known: {', '.join(sorted(LINKS))}") from None
