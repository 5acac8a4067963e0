"""Hardware: device and link specs, cluster topology, tenants' containers."""

from slicesched.hardware.cluster import Cluster, Container, NodeSpec
from slicesched.hardware.specs import DEVICES, LINKS, DeviceSpec, LinkSpec, device_spec, link_spec

__all__ = ["Cluster", "Container", "NodeSpec", "DEVICES", "LINKS", "DeviceSpec", "LinkSpec",
           "device_spec", "link_spec"]
