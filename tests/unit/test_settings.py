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


@pytest.mark.parametrize("key", ["rack", "owner", "doctor_json", "ssh_user", "_sudo"])
def test_keys_that_are_no_near_miss_pass(key):
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
