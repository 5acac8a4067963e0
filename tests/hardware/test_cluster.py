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


def test_a_transfer_between_servers_takes_the_slower_of_their_networks():
    c = Cluster((NodeSpec("H100-80GB", 1), NodeSpec("H100-80GB", 1), NodeSpec("A100-80GB", 1, network="eth-100g")))
    assert c.link(0, 1).name == "ib-ndr"  # the cluster's inter_link where a server names none
    assert c.link(0, 2).name == c.link(2, 1).name == "eth-100g"


def test_a_node_groups_network_reaches_its_servers_and_the_simulated_links():
    from slicesched.cost import make_cost_model
    from slicesched.hardware.specs import link_spec
    from slicesched.sim.network import Paths, fit_link
    from scenario_helpers import scenario

    sc = scenario("""
        [cluster]
        [[cluster.node_groups]]
        name = "fast"
        device = "H100-80GB"
        devices_per_node = 1
        [[cluster.node_groups]]
        name = "slow"
        device = "A100-80GB"
        devices_per_node = 1
        network = "eth-100g"
        [[tenants]]
        name = "a"
        model = "qwen2.5-1.5b"
        [[streams]]
        source = "synthetic"
        tenants = ["a"]
        rate = 1.0
    """)
    cost = make_cost_model("roofline")
    paths = Paths(sc.cluster.build(), cost)
    res, _ = paths.between((0,), (1,))
    assert paths.capacity[("out", 0)] == fit_link(cost, link_spec("ib-ndr"))[0]  # the cluster's default
    assert paths.capacity[("in", 1)] == fit_link(cost, link_spec("eth-100g"))[0]  # the slow group's own
    assert set(res) == {("out", 0), ("in", 1)}


def test_h100_datasheet_numbers():
    h = device_spec("H100-80GB")
    assert h.peak_flops == pytest.approx(989e12) and h.mem_bandwidth == pytest.approx(3.35e12)


def test_unknown_device_type_names_the_known_ones():
    with pytest.raises(KeyError, match="H200-141GB"):
        device_spec("H300")
