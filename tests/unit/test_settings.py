"""Inventory data is checked before anything runs; each error names host, key and fix."""

import pytest

from tasks.settings import DEFAULTS, SettingsError, load_settings


def test_defaults_make_valid_settings():
    s = load_settings("box1", {})
    assert s.artifact_mode == DEFAULTS["artifact_mode"] == "relay"
    assert s.mirrors.base("huggingface") == "https://huggingface.co"
    assert s.marker("cuda") == "/opt/verl-lab/markers/cuda.done"
    assert s.env_python == "/opt/verl-lab/envs/verl/bin/python"
    assert s.model_dir.endswith("/models/Qwen--Qwen2.5-0.5B-Instruct")


def test_cn_profile_points_every_source_at_cn_mirrors():
    s = load_settings("box1", {"mirror_profile": "cn"})
    assert s.mirrors.base("huggingface") == "https://hf-mirror.com"
    assert "tuna" in s.mirrors.base("pypi")


def test_mirror_url_override_reaches_artifact_urls():
    s = load_settings("box1", {"mirror_urls": {"nvidia": "http://127.0.0.1:9/nv"}})
    assert s.url("cudnn_archive").startswith("http://127.0.0.1:9/nv/cudnn/")


@pytest.mark.parametrize("data, key, fix", [
    ({"mirror_profile": "mars"}, "mirror_profile", "set mirror_profile to one of global, cn"),
    ({"mirror_urls": {"nvidia": "nvidia.example.com"}}, "mirror_urls", "http(s) base URL"),
    ({"mirror_urls": {"dockerhub": "https://x.example"}}, "mirror_urls", "source listed"),
    ({"artifact_mode": "torrent"}, "artifact_mode", "relay, direct"),
    ({"catalog_overrides": {"cuda": {"sha256": "0" * 64}}}, "catalog_overrides", "name a catalog artifact"),
    ({"catalog_overrides": {"cudnn_archive": {"sha256": "xyz"}}}, "catalog_overrides", "overridable"),
    ({"ssh_key": "/nonexistent/id_ed25519"}, "ssh_key", "private key file"),
    ({"train_user": "root"}, "train_user", "never runs as root"),
    ({"lab_root": "relative/dir"}, "lab_root", "absolute path"),
    ({"train_steps": 0}, "train_steps", "positive"),
    ({"hf_token_file": "/nonexistent/token"}, "hf_token_file", "chmod 600"),
    ({"model_artifact": "llama"}, "model_artifact", "files/catalog.toml"),
    ({"max_run_days": 0}, "max_run_days", "positive number of days"),
    ({"max_run_days": "a week"}, "max_run_days", "max_run_days = 14"),
])
def test_bad_values_name_host_key_and_fix(data, key, fix):
    with pytest.raises(SettingsError) as err:
        load_settings("gpu-box-7", data)
    text = str(err.value)
    assert text.startswith("host gpu-box-7: " + key + ":"), text
    assert fix in text, text
    assert err.value.key == key


def test_ssh_key_that_exists_is_accepted(tmp_path):
    key = tmp_path / "id"
    key.write_text("key")
    assert load_settings("b", {"ssh_key": str(key)}).host == "b"


@pytest.mark.parametrize("key, meant", [
    ("mirror_profle", "mirror_profile"),
    ("train_step", "train_steps"),
    ("gpu_overrides", "gpu_override"),
    ("train_units_state", "train_unit_state"),
])
def test_near_miss_of_a_setting_names_the_setting_meant(key, meant):
    with pytest.raises(SettingsError) as err:
        load_settings("gpu-box-7", {key: "x"})
    text = str(err.value)
    assert text.startswith(f"host gpu-box-7: {key}:"), text
    assert f"did you mean {meant}" in text, text
    assert err.value.key == key


@pytest.mark.parametrize("key", ["site_rack", "site_owner", "doctor_json", "status_json", "ssh_user", "_sudo"])
def test_keys_read_elsewhere_pass(key):
    """pyinfra's, another deploy's and the site's own (site_*): tests/unit/test_settings_keys.py refuses the rest."""
    assert load_settings("b", {key: "x"}).host == "b"


def pyinfra_host_data_keys():
    """Every host data key pyinfra itself reads: its connectors' data and its global arguments."""
    from importlib.metadata import entry_points

    from pyinfra.api.arguments import all_global_arguments

    keys = {name for name, _ in all_global_arguments()}
    for ep in entry_points(group="pyinfra.connectors"):
        keys |= set(getattr(ep.load(), "data_meta", {}))
    return sorted(keys)


def test_pyinfra_keys_are_never_taken_for_near_misses():
    keys = pyinfra_host_data_keys()
    assert {"ssh_user", "ssh_key", "_sudo", "docker_identifier"} <= set(keys)
    for key in keys:
        assert load_settings("b", {key: None}).host == "b", key


def test_every_problem_of_a_host_is_listed_at_once():
    """Not only the first: a user fixes them all in one go (each line: host, key, value, fix)."""
    data = {"mirror_profle": "cn", "artifact_mode": "torrent", "lab_root": "relative", "train_user": "root",
            "train_steps": 0, "workload": {"epochs": 0, "algoritm": "grpo", "max_response_length": "256"},
            "gpu_override": {"name": "", "compute_capability": "x", "memory_mib": 0}}
    with pytest.raises(SettingsError) as err:
        load_settings("gpu-box-7", data)
    keys = [p.key for p in err.value.problems]
    assert keys == ["mirror_profle", "workload.algoritm", "workload.max_response_length", "workload.epochs",
                    "artifact_mode", "lab_root", "train_user", "train_steps", "gpu_override", "gpu_override",
                    "gpu_override"], keys
    lines = str(err.value).splitlines()
    assert len(lines) == len(keys) and all(line.startswith("host gpu-box-7: ") and ". Fix: " in line
                                           for line in lines), lines
    assert "'torrent' is not one of relay, direct" in str(err.value)
    assert "compute_capability 'x' is not like 8.6" in str(err.value) and "memory_mib 0 is not" in str(err.value)
    # the first problem's fields stay where a single error kept them
    assert (err.value.host, err.value.key) == ("gpu-box-7", "mirror_profle")


def test_one_bad_value_is_one_problem():
    with pytest.raises(SettingsError) as err:
        load_settings("b", {"artifact_mode": "torrent"})
    assert len(err.value.problems) == 1 and str(err.value).count("\n") == 0


def test_the_inventory_check_lists_every_problem_of_every_host(monkeypatch):
    from pyinfra.api import Inventory

    from tasks import hostdata

    for name, value in (("_CHECKED", False), ("_CACHE", {}), ("_CLUSTERS", {})):
        monkeypatch.setattr(hostdata, name, value)
    inv = Inventory((["box1", "box2", ("box3", {"train_steps": -1})], {}),
                    bad=(["box1", "box3"], {"artifact_mode": "torrent"}))
    with pytest.raises(hostdata.InventoryError) as exc:
        hostdata.check_inventory(list(inv))
    lines = str(exc.value).splitlines()
    assert lines[0] == "verl-lab: the inventory has errors; nothing was changed on any host:"
    assert "  host box1: artifact_mode: 'torrent' is not one of relay, direct." in "\n".join(lines)
    assert [line.split(":")[0:2] for line in lines if "box3" in line] == [["  host box3", " artifact_mode"],
                                                                          ["  host box3", " train_steps"]]
    assert not any("box2" in line for line in lines)
