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
