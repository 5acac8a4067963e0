"""Cluster topology: nodes of devices, the links between them, and tenants' containers.

Devices are numbered 0..N-1 cluster-wide. A *device group* (a tuple of device ids) is what a
slice is placed on; a tensor-parallel container is one group. Groups get small integer ids so
that the GMG and the simulator keep placements in numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slicesched.hardware.specs import LINKS, DeviceSpec, LinkSpec, device_spec, link_spec


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A server: `num_devices` devices of one type joined by `intra_link`."""

    device_type: str
    num_devices: int
    intra_link: str = "nvlink4"
    host_link: str = "pcie5"  # host memory <-> each device (weight loads from host)
    network: str | None = None  # each device's network link to other servers; None: the cluster's inter_link


@dataclass(frozen=True, slots=True)
class Container:
    """The devices a tenant owns and its tensor-parallel degree (= number of devices)."""

    tenant: str
    devices: tuple[int, ...]

    @property
    def tp(self) -> int:
        return len(self.devices)


@dataclass(slots=True)
class Cluster:
    """Devices, topology and device groups."""

    nodes: tuple[NodeSpec, ...]
    inter_link: str = "ib-ndr"
    device_specs: tuple[DeviceSpec, ...] = field(init=False)
    device_node: np.ndarray = field(init=False)  # device id -> node index
    _groups: list[tuple[int, ...]] = field(init=False, default_factory=list)
    _group_ids: dict[tuple[int, ...], int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        specs, node_of = [], []
        for n, node in enumerate(self.nodes):
            spec = device_spec(node.device_type)
            link_spec(node.intra_link)
            link_spec(node.host_link)
            specs += [spec] * node.num_devices
            node_of += [n] * node.num_devices
            if node.network is not None:
                link_spec(node.network)
        link_spec(self.inter_link)
        self.device_specs = tuple(specs)
        self.device_node = np.asarray(node_of, dtype=np.int32)
        for d in range(len(specs)):  # every single device is a group, id == device id
            self.group_id((d,))

    @classmethod
    def homogeneous(cls, device_type: str, num_nodes: int, devices_per_node: int,
                    intra_link: str = "nvlink4", inter_link: str = "ib-ndr") -> "Cluster":
        return cls(tuple(NodeSpec(device_type, devices_per_node, intra_link) for _ in range(num_nodes)),
                   inter_link)

    @property
    def num_devices(self) -> int:
        return len(self.device_specs)

    def link(self, a: int, b: int) -> LinkSpec:
        """The path between two devices: none on the same device, the node's fabric, or the network."""
        if a == b:
            return LINKS["local"]
        na, nb = self.device_node[a], self.device_node[b]
        if na == nb:
            return link_spec(self.nodes[na].intra_link)
        return min(self.network(a), self.network(b), key=lambda l: l.bandwidth)  # the slower end

    def network(self, device: int) -> LinkSpec:
        """A device's link to other servers (its node's network, else the cluster's inter_link)."""
        return link_spec(self.nodes[self.device_node[device]].network or self.inter_link)

    def host_link(self, device: int) -> LinkSpec:
        """The path from host memory to a device (each device has its own PCIe link)."""
        return link_spec(self.nodes[self.device_node[device]].host_link)

    def group_id(self, devices: tuple[int, ...]) -> int:
        """Stable small id of a device group, registering it on first use."""
        key = tuple(sorted(devices))
        gid = self._group_ids.get(key)
        if gid is None:
            if not key or key[0] < 0 or key[-1] >= self.num_devices:
                raise ValueError(f"device group {devices} outside 0..{self.num_devices - 1}")
            gid = len(self._groups)
            self._groups.append(key)
            self._group_ids[key] = gid
        return gid

    def group(self, gid: int) -> tuple[int, ...]:
        return self._groups[gid]

    def group_link(self, a: int, b: int) -> LinkSpec:
        """Slowest link between any pair of two groups' devices (activations fan out over it)."""
        ga, gb = self._groups[a], self._groups[b]
        if ga == gb:
            return LINKS["local"]
        return min((self.link(x, y) for x in ga for y in gb), key=lambda l: l.bandwidth)

    def group_intra_link(self, gid: int) -> LinkSpec:
        """The link a tensor-parallel collective inside the group runs over (its slowest hop)."""
        g = self._groups[gid]
        if len(g) == 1:
            return LINKS["local"]
        return min((self.link(g[0], d) for d in g[1:]), key=lambda l: l.bandwidth)
