import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slicesched.config import load_scenario
from slicesched.errors import InputError

GOOD = textwrap.dedent("""\
    name = "two"
    [cluster]
    device = "H100-80GB"
    devices_per_node = 4

    [[tenants]]
    name = "a"
    model = "llama-2-7b"

    [[tenants]]
    name = "b"
    model = "llama-3-8b"
    tp = 2

    [[streams]]
    source = "synthetic"
    tenants = ["a", "b"]
    rate = 2.0
    """)


def write(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_good_scenario_loads(tmp_path):
    s = load_scenario(write(tmp_path, GOOD))
    assert [t.name for t in s.tenants] == ["a", "b"] and s.tenants[1].tp == 2


def test_misspelled_field_fails_with_one_line_naming_it(tmp_path):
    p = write(tmp_path, GOOD.replace('model = "llama-3-8b"', 'modle = "llama-3-8b"'))
    with pytest.raises(InputError) as e:
        load_scenario(p)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{p}:12: field 'tenants[1].modle': unknown field (did you mean 'model'?)" == msg


def test_out_of_range_value_names_field_and_expectation(tmp_path):
    with pytest.raises(InputError, match=r"streams\[0\]\.rate.*greater than 0"):
        load_scenario(write(tmp_path, GOOD.replace("rate = 2.0", "rate = -1.0")))


def test_unknown_stream_source(tmp_path):
    with pytest.raises(InputError, match="'source' must be one of"):
        load_scenario(write(tmp_path, GOOD.replace('"synthetic"', '"poisson"')))


def test_stream_for_unknown_tenant(tmp_path):
    with pytest.raises(InputError, match="unknown tenant"):
        load_scenario(write(tmp_path, GOOD.replace('["a", "b"]', '["a", "c"]')))


def test_too_many_devices_requested(tmp_path):
    with pytest.raises(InputError, match="cluster has 4"):
        load_scenario(write(tmp_path, GOOD.replace("tp = 2", "tp = 4")))


def test_invalid_toml_names_line(tmp_path):
    with pytest.raises(InputError, match=r"s\.toml:3: invalid TOML"):
        load_scenario(write(tmp_path, "name = 'x'\n[cluster]\ndevice = \n"))


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_scenario(tmp_path / "nope.toml")


def test_binary_file_is_one_input_error_with_its_line(tmp_path):
    p = tmp_path / "s.toml"
    p.write_bytes(b'name = "x"\n\n\x89PNG\x00')
    with pytest.raises(InputError, match=r"s\.toml:3: not a text \(UTF-8\) file"):
        load_scenario(p)


def test_folder_is_one_input_error(tmp_path):
    with pytest.raises(InputError, match="is a folder"):
        load_scenario(tmp_path)


@pytest.mark.parametrize("old, new, field, bound", [
    ("rate = 2.0", "rate = 2.0\ncv = 1e9", "streams[0].cv", "20"),
    ("rate = 2.0", "rate = 1e9", "streams[0].rate", "100000"),
    ('tp = 2', 'tp = 2\nmax_num_seqs = 10000000', "tenants[1].max_num_seqs", "65536"),
    ('rate = 2.0', 'rate = 2.0\n[replay]\nduration_s = 1e12', "replay.duration_s", "604800"),
    ('rate = 2.0', 'rate = 2.0\n[replay]\nrate_scales = [1.0, 1e9]', "replay.rate_scales[1]", "10000"),
])
def test_numbers_that_could_hang_or_explode_are_bounded_and_the_bound_named(tmp_path, old, new, field, bound):
    with pytest.raises(InputError) as e:
        load_scenario(write(tmp_path, GOOD.replace(old, new)))
    assert e.value.field == field and bound in e.value.message and e.value.line is not None


def test_unknown_link_is_blamed_on_its_field_and_line(tmp_path):
    with pytest.raises(InputError) as e:
        load_scenario(write(tmp_path, GOOD.replace("devices_per_node = 4", 'devices_per_node = 4\nintra_link = "pcie9"')))
    assert (e.value.line, e.value.field) == (5, "cluster.intra_link")


def test_empty_rate_scales_is_refused(tmp_path):
    with pytest.raises(InputError, match="replay.rate_scales"):
        load_scenario(write(tmp_path, GOOD + "[replay]\nrate_scales = []\n"))


def test_realloc_settings_come_from_their_own_table(tmp_path):
    s = load_scenario(write(tmp_path, GOOD + "[schedulers.realloc]\ninterval_s = 5\n"))
    assert s.schedulers.realloc.interval_s == 5 and s.schedulers.realloc.warmup_s == 2.0


def test_misspelled_realloc_setting_names_its_table(tmp_path):
    with pytest.raises(InputError, match=r"schedulers\.realloc\.intervl_s.*unknown field"):
        load_scenario(write(tmp_path, GOOD + "[schedulers.realloc]\nintervl_s = 5\n"))


def test_pp_defaults_to_one_stage(tmp_path):
    assert [t.pp for t in load_scenario(write(tmp_path, GOOD)).tenants] == [1, 1]


def test_a_replica_of_more_stages_than_the_cluster_holds_is_blamed_on_pp(tmp_path):
    p = write(tmp_path, GOOD.replace("tp = 2", "tp = 2\npp = 3"))
    with pytest.raises(InputError) as e:
        load_scenario(p)
    assert str(e.value) == (f"{p}:14: field 'tenants[1].pp': a replica of tp=2 x pp=3 needs 6 devices, "
                            f"the cluster has 4")


def test_pp_below_one_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"s\.toml:14: field 'tenants\[1\]\.pp': .*greater than or equal to 1"):
        load_scenario(write(tmp_path, GOOD.replace("tp = 2", "tp = 2\npp = 0")))


def test_listed_devices_must_cover_every_stage(tmp_path):
    with pytest.raises(InputError, match="lists 2 devices but tp x pp x replicas = 4"):
        load_scenario(write(tmp_path, GOOD.replace("tp = 2", "tp = 2\npp = 2\ndevices = [2, 3]")))


@given(st.text(max_size=300))
def test_a_name_from_a_file_becomes_a_file_name_that_stays_in_its_folder(name):
    from pathlib import Path

    from slicesched.config.scenario import file_name

    safe = file_name(name)
    assert 1 <= len(safe) <= 100 and not safe.startswith(".")
    assert all(c.isascii() and (c.isalnum() or c in "._+-") for c in safe)
    assert (Path("/runs") / safe).resolve().parent == Path("/runs")


def test_a_name_already_safe_is_kept():
    from slicesched.config.scenario import file_name

    assert file_name("hot-cold_v1.2+slo") == "hot-cold_v1.2+slo" and file_name("..") == "unnamed"
