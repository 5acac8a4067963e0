import pytest

from slicesched.hardware import Cluster, NodeSpec, device_spec


def test_link_inside_a_node_is_its_fabric():
    c = Cluster.homogeneous("H100-80GB", num_nodes=2, devices_per_node=4)
    assert c.link(0, 3).name == "nvlink4"


def test_link_between_nodes_is_the_network():
    c = Cluster.homogeneous("H100-80GB", num_nodes=2, devices_per_node=4, inter_link="ib-hdr")
    assert c.link(0, 4).name == "ib-hdr"


def test_single_devices_are_groups_with_their_own_id():
    c = Cluster.homogeneous("A100-80GB", 1, 4)
    assert [c.group_id((d,)) for d in range(4)] == [0, 1, 2, 3]


def test_group_ids_are_stable_and_order_free():
    c = Cluster.homogeneous("A100-80GB", 1, 4)
    assert c.group_id((2, 3)) == c.group_id((3, 2))
    assert c.group(c.group_id((3, 2))) == (2, 3)


def test_group_outside_cluster_rejected():
    c = Cluster.homogeneous("A100-80GB", 1, 2)
    with pytest.raises(ValueError):
        c.group_id((1, 2))


def test_mixed_nodes_keep_their_device_types():
    c = Cluster((NodeSpec("H100-80GB", 2), NodeSpec("L40S", 2, "pcie4")))
    assert c.device_specs[3].name == "L40S"
    assert c.link(2, 3).name == "pcie4"


def test_h100_datasheet_numbers():
    h = device_spec("H100-80GB")
    assert h.peak_flops == pytest.approx(989e12) and h.mem_bandwidth == pytest.approx(3.35e12)


def test_unknown_device_type_names_the_known_ones():
    with pytest.raises(KeyError, match="H200-141GB"):
        device_spec("H300")
