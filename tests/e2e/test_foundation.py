"""The Foundation issue's must-shows, on real boxes over SSH (Molecule's order):
create -> converge (deploy/full.py, every stage, with every stage's stand-ins) -> verify on
each box -> idempotence (zero changed operations) -> a bad inventory fails before any host
changes -> destroy (the fixture).

The boxes are the converged fleet (tests/e2e/conftest.py ``fleet_lab``): booted and converged
once per run, its first converge ran on never-converged boxes and is what this module verifies;
test_security.py reads the same converge. Its T4 box is the one env with vLLM and the cu118 xformers
that an e2e test builds (tests/e2e/test_env.py's env stage converges a P40). A test here that changes a box
puts it back and proves a re-run changes nothing again."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e import test_env
from tests.e2e.shared_labs import FLEET_BOXES, FLEET_FRESH

REPO = Path(__file__).resolve().parents[2]
BOXES = list(FLEET_BOXES)
FRESH = FLEET_FRESH      # never converged: proves a failed run touched nothing


@pytest.fixture(scope="module")
def lab(fleet_lab):
    return fleet_lab.lab


@pytest.fixture(scope="module")
def converged(fleet_lab):
    fleet_lab.converge.assert_ok()
    return fleet_lab.converge


# ---------------------------------------------------------------- the harness itself

def test_boxes_are_distinct_hosts(lab):
    ids = {}
    for name, box in lab.boxes.items():
        out = box.ssh("hostname; cat /etc/machine-id; systemctl is-system-running || true").stdout.split()
        assert out[0] == box.hostname and out[0].startswith(name)
        assert out[2] in ("running", "degraded")
        ids[name] = out[1]
    assert len(set(ids.values())) == len(ids), f"machine-ids collide: {ids}"


@pytest.mark.parametrize("name,gpu,cc,mem", [
    ("p40", "Tesla P40", "6.1", "24576"),
    ("t4", "Tesla T4", "7.5", "15360"),
])
def test_standin_nvidia_smi_in_box(lab, name, gpu, cc, mem):
    out = lab.box(name).ssh(
        "nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv,noheader,nounits"
    ).stdout
    assert out == f"0, {gpu}, {cc}, {mem}, 535.104.05\n"


def test_box_reaches_mirror_and_dumb_http_git(lab, tmp_path):
    src = tmp_path / "repo"
    src.mkdir()
    (src / "README").write_text("stand-in\n")
    git = ["git", "-C", str(src), "-c", "user.name=lab", "-c", "user.email=lab@example.invalid"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(src)], check=True)
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    subprocess.run([*git, "tag", "v1"], check=True)
    url = lab.mirror.publish_git("github/lab/standin.git", src)
    box = lab.box("t4")
    out = box.ssh(f"rm -rf /tmp/c && git clone -q --branch v1 {url} /tmp/c && cat /tmp/c/README").stdout
    assert out == "stand-in\n"
    lab.mirror.add_file("nvidia/probe.bin", b"x" * 1000)
    got = box.ssh(f"curl -fsS -r 100-199 {lab.mirror_url}/nvidia/probe.bin | wc -c").stdout.strip()
    assert got == "100"


# ---------------------------------------------------------------- converge, verify, idempotence

def test_converge_changes_every_box(converged):
    assert converged.changed > 0
    for name in BOXES:
        assert converged.changed_by_host[name] > 0, converged


@pytest.mark.parametrize("name", BOXES)
def test_verify_base_layout(lab, converged, name):
    box = lab.box(name)
    uid, gid, home, shell = box.ssh("getent passwd verl | cut -d: -f3,4,6,7 --output-delimiter=' '").stdout.split()
    assert int(uid) != 0 and int(gid) != 0
    assert int(uid) < 1000, "the training user is a system user"
    assert (home, shell) == ("/opt/verl-lab/home", "/usr/sbin/nologin")
    groups = box.ssh("id -Gn verl").stdout.split()
    assert not {"root", "sudo", "wheel", "adm", "disk", "shadow"} & set(groups), groups
    sudo = box.ssh("sudo -n -l -U verl", check=False).stdout
    assert "not allowed" in sudo, sudo
    for path, mode in (("/opt/verl-lab", "755"), ("/opt/verl-lab/markers", "755"), ("/opt/verl-lab/cache", "750")):
        assert box.stat(path) == (mode, "root", "root"), path
    # the unprivileged user cannot write the layout
    assert box.ssh("id -un", user="verl").stdout == "verl\n"
    denied = box.ssh("touch /opt/verl-lab/markers/x", user="verl", check=False)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr


STAGES = ("cuda", "env", "data", "train")
PLANS = {  # what each stand-in GPU must get (the plan package, tasks/plan/, decides; docs/plan.md says why)
    "p40": {"rollout": "hf", "train_dtype": "fp32"},
    "t4": {"rollout": "vllm", "train_dtype": "fp32"},
}


@pytest.mark.parametrize("name", BOXES)
def test_verify_every_stage_on_each_box(lab, converged, name):
    box = lab.box(name)
    for stage in STAGES:
        assert box.exists(f"/opt/verl-lab/markers/{stage}.done"), f"{name}: no {stage} marker"
    assert "release 11.8" in box.ssh("/usr/local/cuda-11.8/bin/nvcc --version").stdout
    plan = box.ssh("cat /opt/verl-lab/train/plan.json").stdout
    for key, value in PLANS[name].items():
        assert f'"{key}": "{value}"' in plan, (name, key, plan[:400])
    assert box.ssh("/opt/verl-lab/envs/verl/bin/python -c 'import verl, torch; print(verl.__version__)'").stdout.strip() == "0.5.0"
    assert box.ssh("systemctl is-enabled verl-lab-train.service").stdout.strip() == "enabled"


def test_t4_box_gets_vllm_and_the_cu118_xformers(lab, converged):
    """The env stage on a box that gets vLLM (compute capability 7.5 >= 7.0): the fleet's T4, whose env
    deploy/full.py built with the env stage's own stand-ins (tests/fixtures/standins/fleet.py: env.publish) before
    anything here changes it (test_full_undo.py does, later). tests/e2e/test_env.py proves the same stage on a
    P40 (no vLLM, no xformers); its readers of the marker and of the proofs the build recorded are used here."""
    box = "t4"
    m = test_env.marker(lab, box)
    assert m["vllm"] == "0.8.5" and m["xformers"] == "0.0.29.post2"
    assert "V0 engine" in m["xformers_reason"]
    # the cu118 index's build (the stand-in published there), pinned for vLLM's install
    py, env = test_env.PY, test_env.ENV
    init = test_env.ssh(lab, f"cd / && {py} -c 'import xformers; print(xformers.__file__)'", box=box).stdout.strip()
    assert "stand-in for xformers 0.0.29.post2" in test_env.ssh(lab, f"cat {init}", box=box).stdout
    constraints = test_env.ssh(lab, f"cat {env}/verl-lab-constraints.txt", box=box).stdout.splitlines()
    assert "xformers==0.0.29.post2" in constraints
    # the proofs its build ran on this generation (as in test_env.py's test_converge_builds_a_proven_env)
    p = test_env.built_proof(lab, box)
    assert p["healthy"], p
    assert p["checks"]["gpu"]["detail"] == "skipped: CPU torch stand-in (the box reports compute capability 7.5)"
    assert p["checks"]["xformers"]["detail"] == ("xformers 0.0.29.post2 (the CUDA 11.8 build for torch 2.6.0+cu118,"
                                                 " verl-lab test stand-in): compiled ops loaded")
    assert p["checks"]["vllm"]["detail"] == "vllm 0.8.5+cu118"


def test_second_run_changes_nothing(fleet_lab, converged):
    fleet_lab.deploy().assert_idempotent()


def test_text_mode_sees_one_drifted_box(lab, fleet_lab, converged):
    """The plain (no --json) output is parsed too: drift on one box = changes on that box only."""
    lab.box("t4").ssh("chmod 700 /opt/verl-lab/cache")
    res = fleet_lab.deploy(mode="text").assert_ok()
    assert res.changed_by_host == {"p40": 0, "t4": 1}, res
    assert res.changed == 1
    assert lab.box("t4").stat("/opt/verl-lab/cache")[0] == "750"
    fleet_lab.deploy(mode="text").assert_idempotent()


DRIFTED = {   # file -> (how it is damaged, what the stage puts back: mode, owner, group)
    "/opt/verl-lab/train/train-launcher": ("echo '# edited by hand' >> {p}", ("750", "root", "verl")),
    "/opt/verl-lab/train/train.env": ("chmod 644 {p}", ("640", "root", "verl")),
    "/etc/systemd/system/verl-lab-train.service": ("echo '# edited' >> {p}", ("644", "root", "root")),
    "/opt/verl-lab/env-build/build-env.sh": ("chown verl {p}", ("755", "root", "root")),
    "/opt/verl-lab/patches/verl-0.5.0/0001-autocast-dtype-follows-param-dtype.diff":
        ("rm -f {p}; ln -s /etc/hostname {p}", ("644", "root", "root")),
}


def test_files_the_stages_render_are_put_back(lab, fleet_lab, converged):
    """The stages decide from one fact per stage (tasks/placed.py) but still repair drift: an
    edited, re-moded, re-owned or replaced file on one box is rewritten there, and only there."""
    box = lab.box("p40")
    reload = "systemctl show -p NeedDaemonReload --value verl-lab-train.service"
    before = {p: box.ssh(f"sha1sum {p} | cut -d' ' -f1").stdout for p in DRIFTED if not p.endswith(".diff")}
    patch = next(p for p in DRIFTED if p.endswith(".diff"))
    assert box.exists(patch), "the patch set's first file is not where the test expects it"
    for path, (damage, _) in DRIFTED.items():
        box.ssh(damage.format(p=path))
    assert box.ssh(reload).stdout.strip() == "yes", "systemd did not notice the edited unit"
    res = fleet_lab.deploy().assert_ok()
    assert res.changed_by_host["t4"] == 0, res
    assert res.changed_by_host["p40"] >= len(DRIFTED), res
    for path, (_, want) in DRIFTED.items():
        assert box.ssh(f"test -f {path} && ! test -L {path}", check=False).returncode == 0, path
        assert box.stat(path) == want, path
    for path, sha in before.items():
        assert box.ssh(f"sha1sum {path} | cut -d' ' -f1").stdout == sha, path
    local = REPO / "files" / "patches" / "verl-0.5.0" / patch.rsplit("/", 1)[-1]
    assert box.ssh(f"sha1sum {patch} | cut -d' ' -f1").stdout.strip() == hashlib.sha1(local.read_bytes()).hexdigest()
    assert box.ssh(reload).stdout.strip() == "no", "the rewritten unit was not reloaded"
    fleet_lab.deploy().assert_idempotent()


# ---------------------------------------------------------------- a bad inventory touches nothing

BAD_VALUES = [
    ("mirror_profile", {"mirror_profile": "moon"}, r"set mirror_profile to one of"),
    ("mirror_urls", {"mirror_urls": {"nvidia": "ftp://mirror.example/nvidia"}}, r"http\(s\) base URL"),
    ("ssh_key", {"ssh_key": "/nonexistent/verl-lab/id_ed25519"}, r"private key file"),
    ("catalog_overrides", {"catalog_overrides": {"no_such_artifact": {"version": "1"}}}, r"name a catalog artifact"),
    ("mirror_profle", {"mirror_profle": "cn"}, r"did you mean mirror_profile"),
]


@pytest.mark.parametrize("key,bad,fix", BAD_VALUES,
                         ids=["mirror_profile", "mirror_urls", "ssh_key", "catalog_overrides", "near_miss"])
def test_bad_inventory_fails_before_any_change(lab, fleet_lab, key, bad, fix):
    res = fleet_lab.deploy(hosts=[*BOXES, FRESH], per_host={FRESH: bad})
    out = res.output
    assert res.rc != 0, out
    assert res.changed == 0 and not res.ran_operations, out
    line = re.search(rf"host {FRESH}: {key}: .*", out)
    assert line, f"no message naming host {FRESH} and key {key}:\n{res.tail()}"
    assert "Fix:" in line.group(0) and re.search(fix, line.group(0)), line.group(0)
    assert not lab.box(FRESH).exists("/opt/verl-lab"), "the failed run changed the fresh box"


def test_a_box_that_cannot_train_is_refused_alone_and_the_others_go_on(lab, fleet_lab, converged):
    """A problem only the box shows (the fresh V100's plan: a batch larger than GSM8K's train split, which
    verl's own dataloader check refuses once the box's nvidia-smi names its GPU) refuses that box alone:
    the report comes before any change, the fresh box's only operation is its refusal (it stays untouched),
    and the converged boxes of the same run go on (re-run, nothing to change). The run exits non-zero."""
    res = fleet_lab.deploy(hosts=[*BOXES, FRESH], per_host={FRESH: {"workload": {"train_batch_size": 10000}}},
                           timeout=900)
    out = res.output
    assert res.rc != 0 and res.failed_hosts == [FRESH], res.tail()
    header = next(line.strip() for line in out.splitlines() if line.startswith("verl-lab: ") and " in this run " in line)
    assert header.startswith(f"verl-lab: 1 problem on 1 host of {len(BOXES) + 1} in this run") and header.endswith(
        f"1 host refused and left unchanged ({FRESH}), the other {len(BOXES)} go on ({', '.join(BOXES)}):"), header
    assert re.search(rf"host {FRESH}: workload\.train_batch_size: .*Train dataloader is empty!", out), res.tail()
    assert all(res.changed_by_host[b] == 0 for b in BOXES) and res.changed_by_host.get(FRESH, 0) == 0, res
    assert re.search(r"verl-lab checks: its 1 problem above \(workload\.train_batch_size\); nothing on this box", out)
    assert re.search(rf"verl-lab: {FRESH} \(.*\): checks FAILED; FAILED \(see above\)", out), res.tail()
    assert all(re.search(rf"verl-lab: {b} \(.*\): .*; changed nothing;", out) for b in BOXES), res.tail()
    assert not lab.box(FRESH).exists("/opt/verl-lab"), "the refused box was changed"
