"""The doctor on a real full disk on a lab box: the data stage (direct mode) downloads the model
onto a folder that cannot hold it, fails, and the doctor reading that deploy's output names the
Hugging Face download's disk, the file and the bytes still wanted, never "no rule matched".

Real: pyinfra over SSH, verl-lab's data stage and its box-side download program (hfsnapshot.py,
with real huggingface_hub in the box's venv) against the HF endpoint stand-in, the kernel's ENOSPC
from a 128 KiB tmpfs mounted inside the box on <lab_root>/models (the stand-in model's weights are
430 952 bytes); the doctor's CLI on the saved output. The tmpfs lives in the box's own mount
namespace and is unmounted at the end of the module.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.doctor import diagnose, render
from tests.fixtures.standins import fleet
from tests.fixtures.standins.hf_endpoint import MODEL_REPO, catalog_overrides, standard_endpoint
from tests.lab import BoxSpec

ENV_PREFIX = "/opt/verl-lab/envs/verl"
MODELS = "/opt/verl-lab/models"
BOX = "directbox"
BIG = "model.safetensors"


@pytest.fixture(scope="module")
def endpoint():
    ep = standard_endpoint().start()
    yield ep
    ep.stop()


@pytest.fixture(scope="module")
def lab(lab_factory):
    lab = lab_factory([BoxSpec(BOX, gpu="p40")])
    box = lab.box(BOX)
    fleet.data_env(lab, [BOX], ENV_PREFIX)
    box.ssh(f"mkdir -p {MODELS} && mount -t tmpfs -o size=1g,nr_inodes=4,mode=755 verl-lab-test-full {MODELS}")
    yield lab
    box.ssh(f"umount {MODELS} 2>/dev/null; true", check=False)


@pytest.fixture(scope="module")
def failed(lab, endpoint):
    data = {"mirror_urls": {**lab.mirror_urls, "huggingface": endpoint.url},
            "catalog_overrides": catalog_overrides(endpoint), "env_prefix": ENV_PREFIX}
    return lab.deploy("deploy/data.py", data=data, per_host={BOX: {"artifact_mode": "direct"}}, timeout=600)


def test_the_data_stage_fails_on_the_full_disk(failed):
    assert failed.failed_hosts == [BOX], failed.tail(80)
    assert "No space left on device" in failed.output, failed.tail(80)


def test_the_doctor_names_the_download_disk_and_the_bytes_wanted(failed, endpoint):
    size = len(endpoint.repos[("model", MODEL_REPO)].files[BIG])
    diag = diagnose(BOX, {"deploy/data.py": failed.output})
    assert [f.rule for f in diag.findings] == ["hf-download-disk-full"], render(diag)
    (finding,) = diag.findings
    d = finding.details
    # what the box printed: "verl-lab data: download of URL was cut at 0 of 430952 bytes ([Errno 28] No space
    # left on device: '.../model.safetensors.part'); the partial file ... is kept and the next run resumes it"
    assert d["path"] == f"{MODELS}/Qwen--Qwen2.5-0.5B-Instruct.staging/.parts/{BIG}.part", d
    assert d["file_bytes"] == size and d["needs_at_least_bytes_more"] == size - d["written_bytes"], d
    assert "lab_root" in finding.fix and "controller_cache" in finding.fix
    assert "no rule matched" not in render(diag)


def test_the_cli_on_the_saved_output(failed, tmp_path):
    log = tmp_path / "data-deploy.log"
    log.write_text(failed.output)
    res = subprocess.run([sys.executable, "-m", "tasks.doctor", str(log)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 1 and res.stdout.startswith("== local: failed"), res
    assert "[hf-download-disk-full]" in res.stdout and "no rule matched" not in res.stdout
    assert re.search(rf"path: {MODELS}/", res.stdout), res.stdout
