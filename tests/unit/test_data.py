"""Snapshot download and verification against the HF endpoint stand-in, with the real
huggingface_hub client; the data stage's planning from settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.data import data_plan
from tasks.data import stage as data_stage
from tasks.settings import SettingsError, load_settings
from tests.fixtures.standins.hf_endpoint import (
    DATASET_REPO,
    MODEL_REPO,
    HfEndpoint,
    StandinRepo,
    catalog_overrides,
    standard_repos,
)
from verl_lab_box import hf_snapshot
from verl_lab_box.hf_snapshot import RepoSpec, SnapshotError

BIG = "model.safetensors"


@pytest.fixture(scope="module")
def repos():
    return standard_repos()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(hf_snapshot, "RETRY_SLEEP_S", 0.01)


@pytest.fixture
def endpoint(repos):
    with HfEndpoint(repos) as ep:
        yield ep


def settings_for_endpoint(ep: HfEndpoint, tmp_path: Path, **extra):
    data = {"mirror_urls": {"huggingface": ep.url}, "catalog_overrides": catalog_overrides(ep),
            "controller_cache": str(tmp_path / "cache"), **extra}
    return load_settings("box1", data)


def plan_for(ep, tmp_path, **extra):
    return data_plan(settings_for_endpoint(ep, tmp_path, **extra))


def test_plan_from_settings(endpoint, tmp_path):
    plan = plan_for(endpoint, tmp_path)
    model = endpoint.repos[("model", MODEL_REPO)]
    assert plan.endpoint == endpoint.url
    assert plan.model.revision == model.commit and plan.model.repo_type == "model"
    assert plan.model.files[BIG] == {"size": len(model.files[BIG]), "sha256": model.sha256(BIG)}
    assert plan.dataset.allow == ["main/test-00000-of-00001.parquet", "main/train-00000-of-00001.parquet"]
    assert plan.rows == {"train": 40, "test": 12, "val_small": 12}
    assert plan.model_dir == "/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct"
    assert plan.source_dir == "/opt/verl-lab/data/gsm8k/source"
    assert plan.box_modules() == ("pyarrow",)
    assert plan_for(endpoint, tmp_path, artifact_mode="direct").box_modules() == ("pyarrow", "huggingface_hub")
    # the digest follows what is installed, not how it travels
    assert plan.digest == plan_for(endpoint, tmp_path, artifact_mode="direct").digest


def test_plan_of_the_real_catalog():
    plan = data_plan(load_settings("box1", {"mirror_profile": "cn"}))
    assert plan.endpoint == "https://hf-mirror.com"
    assert plan.rows == {"train": 7473, "test": 1319, "val_small": 64}
    assert plan.model.files["model.safetensors"]["size"] == 988097824
    assert plan.train_file == "main/train-00000-of-00001.parquet"


def test_plan_refuses_moving_revisions_and_wrong_kinds(endpoint, tmp_path):
    over = catalog_overrides(endpoint)
    over["qwen_model"]["revision"] = "main"
    with pytest.raises(SettingsError, match=r"catalog_overrides.qwen_model.revision.*not a 40-digit commit"):
        data_plan(load_settings("box1", {"catalog_overrides": over}))
    with pytest.raises(SettingsError, match=r"model_artifact: artifact 'gsm8k' is of kind 'hf-dataset'"):
        data_plan(load_settings("box1", {"model_artifact": "gsm8k"}))
    over = catalog_overrides(endpoint)
    over["gsm8k"]["files"] = {"data/other.parquet": {"size": 3}}
    with pytest.raises(SettingsError, match="cannot tell which file is the train split"):
        data_plan(load_settings("box1", {"catalog_overrides": over}))


def test_controller_fetch_verifies_and_then_needs_no_network(endpoint, tmp_path):
    settings = settings_for_endpoint(endpoint, tmp_path)
    plan = data_plan(settings)
    mdir = data_stage.controller_snapshot(settings, plan.model, plan.endpoint)
    ddir = data_stage.controller_snapshot(settings, plan.dataset, plan.endpoint)
    model = endpoint.repos[("model", MODEL_REPO)]
    names = sorted(p.relative_to(mdir).as_posix() for p in mdir.rglob("*") if p.is_file())
    assert names == ["LICENSE", "README.md", "config.json", "generation_config.json", "merges.txt",
                     BIG, "tokenizer.json", "tokenizer_config.json", "vocab.json"]   # no onnx/, no .cache
    assert (mdir / BIG).read_bytes() == model.files[BIG]
    stamp = hf_snapshot.read_stamp(mdir)
    assert stamp["digest"] == plan.model.digest and stamp["files"][BIG]["sha256"] == model.sha256(BIG)
    assert sorted(p.relative_to(ddir).as_posix() for p in ddir.rglob("*") if p.is_file()) == \
        ["main/test-00000-of-00001.parquet", "main/train-00000-of-00001.parquet"]       # no socratic/
    assert not hf_snapshot.staging_path(mdir).exists()
    assert hf_snapshot.prove(plan.model, mdir)["model_type"] == "qwen2"

    before = len(endpoint.requests)
    endpoint.set_fault("down")
    try:
        assert data_stage.controller_snapshot(settings, plan.model, plan.endpoint) == mdir
    finally:
        endpoint.clear_fault()
    assert len(endpoint.requests) == before


@pytest.mark.parametrize("fault, message", [
    ("html", r"did not answer the Hub API \(not JSON: an HTML login"),
    ("down", r"cannot reach the endpoint"),
])
def test_endpoint_faults_name_endpoint_repo_revision_and_fix(endpoint, tmp_path, fault, message):
    plan = plan_for(endpoint, tmp_path)
    dest = tmp_path / "m"
    endpoint.set_fault(fault)
    try:
        with pytest.raises(SnapshotError, match=message) as err:
            hf_snapshot.fetch(plan.model, dest, endpoint.url, progress=False)
    finally:
        endpoint.clear_fault()
    text = str(err.value)
    assert endpoint.url in text and MODEL_REPO in text and plan.model.revision in text
    assert "mirror_profile = 'cn'" in text and "mirror_urls" in text
    assert not dest.exists() and hf_snapshot.read_stamp(dest) is None


def test_unknown_repo_and_revision(endpoint, tmp_path):
    plan = plan_for(endpoint, tmp_path)
    nope = RepoSpec("qwen_model", "Nobody/no-such-model", plan.model.revision, "model", patterns=("*.json",))
    with pytest.raises(SnapshotError, match=r"no such repo .*catalog_overrides.qwen_model.repo"):
        hf_snapshot.fetch(nope, tmp_path / "a", endpoint.url, progress=False)
    gone = RepoSpec("qwen_model", MODEL_REPO, "0" * 40, "model", patterns=("*.json",))
    with pytest.raises(SnapshotError, match=r"no such revision. Fix: pin an existing commit in "
                                            r"catalog_overrides.qwen_model.revision"):
        hf_snapshot.fetch(gone, tmp_path / "b", endpoint.url, progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_catalog_disagreeing_with_the_endpoint_stops_before_download(endpoint, tmp_path):
    plan = plan_for(endpoint, tmp_path)
    files = {**plan.model.files, BIG: {"size": 988097824, "sha256": "f" * 64}}
    spec = RepoSpec("qwen_model", MODEL_REPO, plan.model.revision, "model", files, hf_snapshot.MODEL_PATTERNS)
    endpoint.reset_counters()
    with pytest.raises(SnapshotError, match=r"model.safetensors is listed with \d+ bytes, the catalog says 988097824"):
        hf_snapshot.fetch(spec, tmp_path / "m", endpoint.url, progress=False)
    assert endpoint.served("/resolve/") == 0


def test_cut_download_fails_then_resumes_on_the_next_run(endpoint, tmp_path):
    plan = plan_for(endpoint, tmp_path)
    dest = tmp_path / "m"
    size = len(endpoint.repos[("model", MODEL_REPO)].files[BIG])
    endpoint.set_fault("cut")
    with pytest.raises(OSError, match=r"was cut at \d+ of \d+ bytes.*next run resumes") as err:
        hf_snapshot.fetch(plan.model, dest, endpoint.url, progress=False)
    assert BIG in str(err.value)
    assert not dest.exists(), "a partial snapshot must never be in place"
    part = hf_snapshot.staging_path(dest) / ".parts" / (BIG + ".part")
    assert part.stat().st_size == size // 2
    endpoint.clear_fault()
    endpoint.reset_counters()
    hf_snapshot.fetch(plan.model, dest, endpoint.url, progress=False)
    resumed = endpoint.ranged_gets(BIG)
    assert [s.range for s in resumed] == [f"bytes={size // 2}-"]
    assert endpoint.served(BIG) == size - size // 2
    assert hf_snapshot.prove(plan.model, dest)["files"] == 9


def test_single_cut_is_resumed_within_the_run(endpoint, tmp_path):
    plan = plan_for(endpoint, tmp_path)
    endpoint.set_fault("cut", times=1)
    hf_snapshot.fetch(plan.dataset, tmp_path / "d", endpoint.url, progress=False)
    assert any(s.range and not s.range.startswith("bytes=0-") for s in endpoint.ranged_gets(".parquet"))
    assert hf_snapshot.prove(plan.dataset, tmp_path / "d")["files"] == 2


def test_token_is_sent_but_never_shown(tmp_path):
    secret = "hf_TESTTOKEN_do_not_print_0123456789"
    with HfEndpoint(standard_repos(token=secret)) as ep:
        settings = settings_for_endpoint(ep, tmp_path)
        plan = data_plan(settings)
        with pytest.raises(SnapshotError, match=r"no such repo \(or it is private\).*hf_token_file") as err:
            hf_snapshot.fetch(plan.dataset, tmp_path / "d0", ep.url, progress=False)
        assert secret not in str(err.value)
        token_file = tmp_path / "token"
        token_file.write_text(secret + "\n")
        token_file.chmod(0o600)
        settings = settings_for_endpoint(ep, tmp_path, hf_token_file=str(token_file))
        assert data_stage.hf_token(settings) == secret
        ddir = data_stage.controller_snapshot(settings, plan.dataset, plan.endpoint)
        assert hf_snapshot.prove(plan.dataset, ddir)["files"] == 2
        assert all(s.authorized for s in ep.requests[-4:])
        # the box-side command line (direct mode) reads the token from a file, never from argv
        spec_file = tmp_path / "spec.json"
        spec_file.write_text(json.dumps(plan.model.to_json()))
        env = {**os.environ, "HF_ENDPOINT": ep.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        run = subprocess.run([sys.executable, hf_snapshot.__file__, "fetch", "--spec", str(spec_file), "--dest",
                              str(tmp_path / "box-model"), "--token-file", str(token_file)],
                             capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr
        assert "9 files verified" in run.stdout
        assert secret not in run.stdout + run.stderr
        bad = subprocess.run([sys.executable, hf_snapshot.__file__, "fetch", "--spec", str(spec_file), "--dest",
                              str(tmp_path / "box-model2")], capture_output=True, text=True, env=env)
        assert bad.returncode == 1 and "verl-lab data:" in bad.stderr and ep.url in bad.stderr


def test_relay_install_checks_every_pushed_file(endpoint, tmp_path):
    settings = settings_for_endpoint(endpoint, tmp_path)
    plan = data_plan(settings)
    local = data_stage.controller_snapshot(settings, plan.model, plan.endpoint)
    manifest = hf_snapshot.read_stamp(local)["files"]
    staging = tmp_path / "box" / "model.staging"
    shutil.copytree(local, staging)
    (staging / BIG).write_bytes(b"\0" * manifest[BIG]["size"])        # same size, other bytes
    dest = tmp_path / "box" / "model"
    with pytest.raises(SnapshotError, match=r"model.safetensors has sha256 [0-9a-f]{64}, expected"):
        hf_snapshot.install(plan.model, staging, dest, manifest)
    assert not dest.exists() and not (staging / BIG).exists()        # deleted: re-pushed next run
    shutil.copyfile(local / BIG, staging / BIG)
    hf_snapshot.install(plan.model, staging, dest, manifest)
    assert hf_snapshot.prove(plan.model, dest)["model_type"] == "qwen2"
    assert not staging.exists()
    (dest / "config.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="config.json"):
        hf_snapshot.prove(plan.model, dest)


def test_model_without_model_type_is_refused(tmp_path):
    files = {"config.json": b'{"hidden_size": 8}', "tokenizer.json": b"{}"}
    with HfEndpoint([StandinRepo("me/odd", "model", files)]) as ep:
        spec = RepoSpec("qwen_model", "me/odd", ep.repos[("model", "me/odd")].commit, "model",
                        patterns=hf_snapshot.MODEL_PATTERNS)
        with pytest.raises(SnapshotError, match="config.json names no model_type"):
            hf_snapshot.fetch(spec, tmp_path / "m", ep.url, progress=False)
        assert not (tmp_path / "m").exists()


def test_legacy_repo_info_api(endpoint):
    # huggingface_hub < 1.0 lists snapshot files from repo info siblings: served too
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint.url).dataset_info(DATASET_REPO, revision="main")
    assert info.sha == endpoint.repos[("dataset", DATASET_REPO)].commit
    assert "main/train-00000-of-00001.parquet" in [s.rfilename for s in info.siblings]


def test_too_little_disk_for_the_model_fails_before_any_fetch():
    """A 3B model's weights are 6 GB: the data stage measures the free disk where the model goes
    before it fetches anything, and says how much is needed."""
    from tasks.data.stage import disk_shortfall

    plan = data_plan(load_settings("box1", {"workload": {"model": "Qwen/Qwen2.5-3B-Instruct"}}))
    disk = {"path": "/opt", "filesystem": "/dev/vda1", "mount": "/", "size_mib": 20000, "free_mib": 4000}
    text = disk_shortfall([plan.model, plan.dataset], disk, plan.model_dir)
    assert text.startswith("not enough free disk on / for Qwen/Qwen2.5-3B-Instruct@aa8e72537993 and openai/gsm8k@")
    need = int(text.split("MiB free, ")[1].split(" MiB")[0])
    assert 6500 < need < 7500 and "set lab_root to a larger filesystem" in text
    assert disk_shortfall([plan.model], {**disk, "free_mib": 8000}, plan.model_dir) is None
    assert disk_shortfall([], None, plan.model_dir) is None        # both proven: nothing to fetch, nothing measured
    assert "could not measure free disk" in disk_shortfall([plan.model], None, plan.model_dir)
