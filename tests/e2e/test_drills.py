"""Fault drills on lab-in-a-box hosts: each fault, then the next run converges and loses nothing.

1. a deploy killed at a seeded random operation (10 trials over the CUDA, base, data and
   training stages, relay and direct mode): after each kill, every marker on a box belongs to a
   stage whose proofs pass; the next run converges; at the end a re-run changes nothing;
2. a cached artifact truncated or corrupted in the controller's cache and in the box's cache:
   caught, fetched again, never installed;
3. the mirror answers 500, an HTML page, or stalls, in relay and direct mode: a clear error with
   the URL, a bounded number of tries, no partial file kept as complete; then a clean converge;
4. among six boxes, one with a too-old driver, one with too little disk and one without a GPU
   fail, each with its reason, and the three others finish;
5. the Python env broken four ways (Apex extension deleted, a verl patch reverted, verl's
   install removed, torch uninstalled): the PythonEnv health fact names each; one
   deploy/rebuild.py restores it (the old generation kept as .prev); a rebuild killed midway
   leaves the old env working.

Drills 1-4 run the cheap stages (deploy/cuda.py, deploy/data.py, deploy/train.py in one pyinfra
run; the data stage gets a plain venv with pyarrow + huggingface_hub instead of the env stage's
env). Drill 5 runs the env stage (deploy/env.py, deploy/rebuild.py) with the helpers of
tests/e2e/test_env.py. What each stage's own e2e test proves is not repeated here (see
docs/drills.md).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tasks.facts.env import PythonEnv
from tests.e2e import test_env
from tests.fixtures.standins import cuda as cuda_standin
from tests.fixtures.standins import env as env_standin
from tests.fixtures.standins import fleet
from tests.fixtures.standins.hf_endpoint import DATASET_REPO, MODEL_REPO
from tests.lab import BoxSpec
from tests.lab.results import DeployResult, parse, strip_ansi

REPO = Path(__file__).resolve().parents[2]
SEED = 20268                         # issue 8
CHEAP = ("deploy/cuda.py", "deploy/data.py", "deploy/train.py")   # CUDA, base + data, base + training
LAB_ROOT = "/opt/verl-lab"
ENV_PREFIX = f"{LAB_ROOT}/envs/verl"       # drills 1-4: a plain venv the data stage uses
PREFIX = "/usr/local/cuda-11.8"
MARKERS = f"{LAB_ROOT}/markers"
MODEL_DIR = f"{LAB_ROOT}/models/Qwen--Qwen2.5-0.5B-Instruct"
DATA_DIR = f"{LAB_ROOT}/data/gsm8k"
UNIT = "/etc/systemd/system/verl-lab-train.service"
RUNFILE = "cuda_runfile"
CUDNN = "cudnn_archive"

FLEET_GOOD = ["good1", "good2", "good3"]
FLEET_BAD = {"olddrv": "NVIDIA driver 470.82.01 is too old for CUDA 11.8",
             "tinydisk": "not enough free disk on /mnt/tiny (tmpfs)",
             "nogpu": "no NVIDIA driver found"}


# ------------------------------------------------------------------ running pyinfra, killing it

# Run in a box with python3: SIGKILL every ssh session but the caller's, with all it started
# (the remote side of a killed deploy), by PID. Prints what it killed.
KILL_SESSIONS = r"""
import os, signal
procs = {}
for d in os.listdir("/proc"):
    if not d.isdigit():
        continue
    try:
        stat = open(f"/proc/{d}/stat").read()
        cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        continue
    procs[int(d)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd)
mine, p = set(), os.getpid()
while p in procs and p not in mine:
    mine.add(p)
    p = procs[p][0]
children = {}
for pid, (ppid, _) in procs.items():
    children.setdefault(ppid, []).append(pid)
stack = [pid for pid, (_, cmd) in procs.items() if cmd.startswith("sshd: root") and pid not in mine]
doomed = set()
while stack:
    pid = stack.pop()
    if pid in doomed or pid in mine:
        continue
    doomed.add(pid)
    stack.extend(children.get(pid, []))
for pid in doomed:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print(" | ".join(procs[pid][1][:80] for pid in sorted(doomed)))
"""


_RUNS = itertools.count(1)


def inventory(lab, hosts, data, per_host=None, number: int | None = None) -> Path:
    number = number or next(_RUNS)
    return lab.write_inventory(data, {h: v for h, v in (per_host or {}).items() if h in hosts}, hosts,
                               path=lab.dir / f"inventory-drill-{number}.py")


def operation_list(lab, files, hosts, data, per_host=None) -> list[str]:
    """The operations a run would execute now, in order (pyinfra --debug-operations)."""
    inv = inventory(lab, hosts, data, per_host)
    proc = subprocess.run([sys.executable, "-m", "pyinfra", "-y", "--json", "--debug-operations", str(inv), *files],
                          cwd=REPO, env=lab.pyinfra_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout[proc.stdout.find("{"):])
    return [" / ".join(sorted(op["names"])) for op in doc["op_order"]]


class Killed:
    """What a killed run left: the result (rc -9), the operation it was in, what died in the boxes."""

    def __init__(self, result: DeployResult, at: str | None, remote: dict[str, str]):
        self.result, self.at, self.remote = result, at, remote


def kill_remote(lab, hosts) -> dict[str, str]:
    out: dict[str, str] = {}

    def one(name):
        out[name] = lab.box(name).ssh("python3 -", input=KILL_SESSIONS, check=False, timeout=60).stdout.strip()

    threads = [threading.Thread(target=one, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run(lab, files, hosts, data, per_host=None, trigger=None, timeout=900) -> DeployResult | Killed:
    """One pyinfra run over ``hosts``. With ``trigger(line_or_None) -> bool`` (called for every
    stderr line, and with None every 0.2 s), the run is killed when it answers True: pyinfra is
    stopped (SIGSTOP), every ssh session it has in the boxes is killed with what it runs, then
    pyinfra gets SIGKILL, as when the controller dies mid-run."""
    number = next(_RUNS)
    inv = inventory(lab, hosts, data, per_host, number)
    cmd = [sys.executable, "-m", "pyinfra", "-y", "--json", str(inv), *files]
    proc = subprocess.Popen(cmd, cwd=REPO, env=lab.pyinfra_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: queue.Queue = queue.Queue()
    err_lines: list[str] = []
    out_chunks: list[str] = []
    t_err = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr] + [lines.put(EOFError)], daemon=True)
    t_out = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    t_err.start()
    t_out.start()
    deadline = time.monotonic() + timeout
    current, killed, remote = None, False, {}
    while True:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            line = None
        if line is EOFError:
            break
        starting = None
        if line is not None:
            err_lines.append(line)
            text = strip_ansi(line)
            if "--> Starting operation:" in text:
                starting = text.split("--> Starting operation:", 1)[1].strip()
        if trigger is not None and not killed and trigger(None if line is None else strip_ansi(line)):
            os.kill(proc.pid, signal.SIGSTOP)
            remote = kill_remote(lab, hosts)
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
        elif starting is not None and not killed:
            current = starting
        if time.monotonic() > deadline and not killed:
            proc.kill()
            killed = True
    rc = proc.wait()
    t_out.join(timeout=10)
    err = "".join(err_lines)
    (lab.dir / f"deploy-drill-{number}.log").write_text(f"$ {' '.join(cmd)}\n# rc {rc}\n{err}\n"
                                                          f"--- stdout\n{''.join(out_chunks)}")
    res = parse(cmd, rc, "".join(out_chunks), err, list(hosts))
    if killed and trigger is not None:
        return Killed(res, current, remote)
    return res


def at_operation(n: int, delay: float = 0.0):
    """A trigger: kill ``delay`` seconds into the n-th (1-based) operation of the run, or as the
    next one starts, whichever comes first (so the kill lands in operation n)."""
    state = {"seen": 0, "since": None}

    def trigger(line):
        if line and "--> Starting operation:" in line:
            state["seen"] += 1
            if state["seen"] == n:
                state["since"] = time.monotonic()
            elif state["seen"] > n:
                return True
        return state["since"] is not None and time.monotonic() - state["since"] >= delay

    return trigger


def at_line(fragment: str):
    return lambda line: bool(line) and fragment in line


# ------------------------------------------------------------------ proofs, by hand

# Run in a box by the data venv's python: what the proofs below look at, in one round trip,
# for the stages that have a marker.
PROBE = r"""
import hashlib, json, os, subprocess, sys
want = json.loads(sys.argv[1])
out = {"markers": {}, "listing": sorted(os.listdir(want["markers"])) if os.path.isdir(want["markers"]) else []}
def read(path):
    try:
        return open(path).read()
    except OSError:
        return None
def sh(cmd):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return [r.returncode, r.stdout + r.stderr]
for stage in ("cuda", "data", "train"):
    out["markers"][stage] = read(os.path.join(want["markers"], stage + ".done"))
m = out["markers"]
if m["cuda"] is not None:
    p = want["prefix"]
    out["nvcc"] = sh(p + "/bin/nvcc --version")
    out["cudnn_h"] = read(p + "/include/cudnn_version.h")
    out["in_progress"] = os.path.exists(p + "/.verl-lab-in-progress")
    out["sizes"] = {f: os.path.getsize(os.path.join(p, f)) if os.path.isfile(os.path.join(p, f)) else None
                    for f in want["toolkit_files"]}
if m["data"] is not None:
    d = want["model_dir"]
    out["model_sha"] = {n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
                        if os.path.isfile(os.path.join(d, n)) else None for n in want["model_files"]}
    out["staging"] = os.path.exists(d + ".staging")
    try:
        import pyarrow.parquet as pq
        out["rows"] = {n: pq.read_table(os.path.join(want["data_dir"], n + ".parquet")).num_rows
                       for n in ("train", "test", "val_small")}
    except Exception as exc:
        out["rows"] = repr(exc)
if m["train"] is not None:
    out["plan"] = read(want["train_dir"] + "/plan.json")
    out["verify"] = sh("systemd-analyze verify " + want["unit"])
    out["overrides"] = sh("runuser -u verl -- /usr/bin/python3 " + want["train_dir"] + "/train-launcher --print-overrides")
    out["enabled"] = sh("systemctl is-enabled verl-lab-train.service")[1].strip()
print(json.dumps(out))
"""


def marker_dict(text: str) -> dict:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def probe(lab, name: str) -> dict:
    model = lab.hf_endpoint.repos[("model", MODEL_REPO)]
    want = {"markers": MARKERS, "prefix": PREFIX, "toolkit_files": [f for f, size in cuda_standin.TOOLKIT_FILES if size],
            "model_dir": MODEL_DIR, "model_files": sorted(model.files), "data_dir": DATA_DIR,
            "train_dir": f"{LAB_ROOT}/train", "unit": UNIT}
    # the data venv's python reads the parquet files; a box without it has no data to prove
    py = f"{ENV_PREFIX}/bin/python"
    res = lab.box(name).ssh(f"py={py}; [ -x $py ] || py=python3; $py - '{json.dumps(want)}'", input=PROBE,
                            timeout=120)
    return json.loads(res.stdout)


def prove_cuda(got: dict, marker: dict, overrides: dict) -> None:
    assert {"stage", "nvcc_version", "cudnn_header", "prefix", "runfile_sha256", "cudnn_sha256", "written"} <= set(marker)
    assert got["nvcc"][0] == 0 and "Cuda compilation tools, release 11.8, V11.8.89" in got["nvcc"][1], got["nvcc"]
    assert marker["nvcc_version"] == "11.8.89" and marker["cudnn_header"] == "8.9.7"
    assert "#define CUDNN_MAJOR 8\n#define CUDNN_MINOR 9\n#define CUDNN_PATCHLEVEL 7\n" in (got["cudnn_h"] or "")
    assert not got["in_progress"]
    assert marker["runfile_sha256"] == overrides[RUNFILE]["sha256"]
    assert marker["cudnn_sha256"] == overrides[CUDNN]["sha256"]
    sizes = dict((f, size) for f, size in cuda_standin.TOOLKIT_FILES if size)
    assert got["sizes"] == sizes, "the toolkit tree is not whole"


def prove_data(got: dict, marker: dict, endpoint) -> None:
    assert {"stage", "digest", "model_revision", "dataset_revision", "train_rows", "artifact_mode"} <= set(marker)
    model = endpoint.repos[("model", MODEL_REPO)]
    assert marker["model_revision"] == model.commit
    assert marker["dataset_revision"] == endpoint.repos[("dataset", DATASET_REPO)].commit
    kept = {n: sha for n, sha in got["model_sha"].items() if sha is not None}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(kept)
    assert kept == {n: hashlib.sha256(model.files[n]).hexdigest() for n in kept}
    assert isinstance(got["rows"], dict), got["rows"]
    rows = got["rows"]
    assert (str(rows["train"]), str(rows["test"]), str(rows["val_small"])) == (
        marker["train_rows"], marker["test_rows"], marker["val_rows"])
    assert not got["staging"]


def prove_train(got: dict, marker: dict) -> None:
    assert {"stage", "digest", "gpu", "launcher", "unit", "unit_state"} <= set(marker)
    plan = json.loads(got["plan"])
    assert got["verify"][0] == 0, got["verify"]
    assert got["overrides"][0] == 0 and got["overrides"][1].splitlines() == plan["overrides"]
    assert got["enabled"] == "enabled"


def proven_markers(lab, name: str, overrides: dict) -> set[str]:
    """Every marker on the box belongs to a stage whose proofs pass (checked here, by hand).
    Returns the stages that have a marker."""
    got = probe(lab, name)
    unknown = [f for f in got["listing"] if f not in ("cuda.done", "data.done", "train.done")]
    assert not unknown, f"{name}: unexpected files among the markers: {unknown}"
    found = set()
    for stage, prove in (("cuda", lambda m: prove_cuda(got, m, overrides)),
                         ("data", lambda m: prove_data(got, m, lab.hf_endpoint)),
                         ("train", lambda m: prove_train(got, m))):
        text = got["markers"][stage]
        if text is None:
            continue
        found.add(stage)
        try:
            prove(marker_dict(text))
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise AssertionError(f"{name}: the {stage} marker is there but the stage's proofs fail: "
                                 f"{type(exc).__name__}: {exc}") from exc
    return found


# ------------------------------------------------------------------ the lab

@pytest.fixture(scope="module")
def lab(lab_factory):
    """One lab (one mirror, one HF endpoint) for drills 1-4; each drill boots its own boxes."""
    lab = lab_factory()
    with fleet.published(lab, env=False, cuda_step_seconds=0.1) as data:
        lab.drill_data = data
        yield lab


def boot(lab, specs, data_env=False):
    """Boot ``specs`` for one drill (in batches of four) and give them the data stage's venv."""
    specs = [BoxSpec.of(s) for s in specs]
    for i in range(0, len(specs), 4):
        lab.boot(specs[i:i + 4])
    if data_env:
        fleet.data_env(lab, [s.name for s in specs], ENV_PREFIX)
    return [s.name for s in specs]


def shut(lab, names):
    for name in names:
        lab.stop_box(name)


def data_for(lab, **extra) -> dict:
    return {**lab.drill_data, **extra}


def overrides(lab) -> dict:
    return lab.drill_data["catalog_overrides"]


# ------------------------------------------------------------------ 1. killed at a random operation

RESET = (f"rm -rf {MARKERS} {LAB_ROOT}/cache {LAB_ROOT}/models {LAB_ROOT}/data {LAB_ROOT}/train "
         f"{LAB_ROOT}/libexec {LAB_ROOT}/secrets {PREFIX} /var/tmp/verl-lab {UNIT} "
         "/etc/systemd/system/multi-user.target.wants/verl-lab-train.service && systemctl daemon-reload"
         # the base stage decides from facts: without its user it runs the same operations as on
         # the fresh box the operation list was taken from
         " && (userdel -r verl >/dev/null 2>&1 || true)")
STAGE_OF = {"CUDA": "CUDA 11.8 toolkit", "base": "verl-lab base layout", "data": "verl-lab model and dataset",
            "train": "verl-lab training plan"}
TRIAL_STAGES = ("CUDA", "data", "train", "base", "CUDA", "data", "train", "CUDA", "data", "train")


def kill_trial(lab, name: str, mode: str, trial: int, n: int, delay: float, ops: list[str]) -> str:
    """Reset the box's verl-lab state, kill a run in operation n, check the markers, converge."""
    per_host = {name: {"artifact_mode": mode}}
    data = data_for(lab, controller_cache=str(lab.dir / f"controller-cache-kill-{trial}"))
    lab.box(name).ssh(RESET)
    killed = run(lab, CHEAP, [name], data, per_host, trigger=at_operation(n, delay))
    assert isinstance(killed, Killed), f"trial {trial}: the run ended before operation {n}: {killed}"
    assert killed.result.rc != 0
    done = sorted(proven_markers(lab, name, overrides(lab)))
    line = (f"trial {trial} ({name}, {mode}): killed in op {n}/{len(ops)} ({ops[n - 1]}; {delay}s at most) "
            f"-> markers left {done}; killed in the box: {killed.remote[name] or 'nothing running'}")
    again = run(lab, CHEAP, [name], data, per_host)
    assert again.ok, f"trial {trial}: the run after the kill did not converge:\n{again.tail(80)}\n{line}"
    assert proven_markers(lab, name, overrides(lab)) == {"cuda", "data", "train"}, line
    return line


def test_killed_at_a_random_operation_converges_next_run(lab):
    """10 seeded trials, two at a time (a relay box and a direct box, each its own pyinfra run)."""
    rng = random.Random(SEED)
    boxes = boot(lab, [BoxSpec("killr", gpu="t4"), BoxSpec("killd", gpu="rtx3090")], data_env=True)
    modes = dict(zip(boxes, ("relay", "direct"), strict=True))
    ops = {name: operation_list(lab, CHEAP, [name], data_for(lab), {name: {"artifact_mode": modes[name]}})
           for name in boxes}
    plan = []
    for trial, stage in enumerate(TRIAL_STAGES, 1):
        name = boxes[(trial - 1) % 2]
        candidates = [i for i, op in enumerate(ops[name], 1) if op.startswith(STAGE_OF[stage])]
        plan.append((name, trial, rng.choice(candidates), round(rng.uniform(0, 2.0), 2)))
    report: list[str] = []
    errors: list[BaseException] = []
    for pair in (plan[i:i + 2] for i in range(0, len(plan), 2)):
        def one(name, trial, n, delay):
            try:
                report.append(kill_trial(lab, name, modes[name], trial, n, delay, ops[name]))
            except BaseException as exc:        # re-raised below, after the pair finished
                errors.append(exc)
        threads = [threading.Thread(target=one, args=args) for args in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    print("\n".join(sorted(report, key=lambda r: int(r.split()[1]))))
    for name in boxes:
        per_host = {name: {"artifact_mode": modes[name]}}
        run(lab, CHEAP, [name], data_for(lab, controller_cache=str(lab.dir / "controller-cache-kill-10")),
            per_host).assert_idempotent()
    shut(lab, boxes)


# ------------------------------------------------------------------ 2. a cached artifact corrupted or truncated

def controller_copy_path(cache: Path, name: str) -> Path:
    art = cuda_standin.default_catalog().artifact(name)
    return cache / "artifacts" / art.name / art.version / art.filename


def url_path(name: str) -> str:
    art = cuda_standin.default_catalog().artifact(name)
    return f"/{art.source}/{art.path}"


def box_cache_path(name: str) -> str:
    art = cuda_standin.default_catalog().artifact(name)
    return f"{LAB_ROOT}/cache/{art.name}/{art.filename}"


def spoil(path: Path) -> None:
    """Corrupt in place, same size: the stand-in runfile's nvcc would say V11.8.88 (so an
    install from this copy shows in the marker), or one byte flipped for anything else."""
    data = bytearray(path.read_bytes())
    at = data.find(b"V11.8.89")
    if at >= 0:
        data[at:at + 8] = b"V11.8.88"
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def test_controller_cache_truncated_or_corrupted_is_fetched_again(lab):
    """The relay copies in the controller's cache: cuDNN cut to half its size, the runfile
    changed in place (same size); a box that needs both gets good copies, fetched again."""
    first, second = boot(lab, [BoxSpec("cachec1", gpu="t4"), BoxSpec("cachec2", gpu="t4")])
    cache = lab.dir / "controller-cache-drill2"
    data = data_for(lab, controller_cache=str(cache))
    run(lab, ("deploy/cuda.py",), [first], data).assert_ok()
    sizes = {name: overrides(lab)[name]["size"] for name in (RUNFILE, CUDNN)}
    truncate(controller_copy_path(cache, CUDNN))
    spoil(controller_copy_path(cache, RUNFILE))
    lab.mirror.reset_counters()
    res = run(lab, ("deploy/cuda.py",), [second], data)
    assert res.ok, res.tail(60)
    for name in (RUNFILE, CUDNN):
        assert lab.mirror.served(url_path(name)) == sizes[name], f"{name} was not fetched again"
        local = controller_copy_path(cache, name)
        assert hashlib.sha256(local.read_bytes()).hexdigest() == overrides(lab)[name]["sha256"]
    assert proven_markers(lab, second, overrides(lab)) == {"cuda"}
    run(lab, ("deploy/cuda.py",), [first, second], data).assert_idempotent()
    shut(lab, [first, second])


def test_box_cache_truncated_or_corrupted_is_fetched_again(lab):
    """The box's own cache (direct mode): a run killed after both downloads leaves them verified
    there; then cuDNN is cut to half and the runfile changed in place. The next run must fetch
    both again and install only good copies."""
    (name,) = boot(lab, [BoxSpec("cacheb", gpu="t4")])
    box = lab.box(name)
    data = data_for(lab, artifact_mode="direct")
    killed = run(lab, ("deploy/cuda.py",), [name], data, trigger=at_line("| CUDA install script"))
    assert isinstance(killed, Killed)
    for art in (RUNFILE, CUDNN):
        assert box.exists(box_cache_path(art)) and box.exists(box_cache_path(art) + ".sha256"), art
    assert not box.exists(PREFIX) and read_marker_text(box, "cuda") is None
    truncate(box.root / box_cache_path(CUDNN).lstrip("/"))
    spoil(box.root / box_cache_path(RUNFILE).lstrip("/"))
    lab.mirror.reset_counters()
    res = run(lab, ("deploy/cuda.py",), [name], data)
    assert res.ok, res.tail(60)
    for art in (RUNFILE, CUDNN):
        assert lab.mirror.served(url_path(art)) == overrides(lab)[art]["size"], f"{art} was not fetched again"
    marker = marker_dict(read_marker_text(box, "cuda"))
    assert marker["nvcc_version"] == "11.8.89", "the corrupted runfile was installed"
    assert proven_markers(lab, name, overrides(lab)) == {"cuda"}
    run(lab, ("deploy/cuda.py",), [name], data).assert_idempotent()
    shut(lab, [name])


def read_marker_text(box, stage: str) -> str | None:
    path = f"{MARKERS}/{stage}.done"
    return box.read_text(path) if box.exists(path) else None


# ------------------------------------------------------------------ 3. the mirror fails

def faulted(lab, path: str, fault: str) -> int:
    return sum(1 for r in lab.mirror.requests if r.path == path and r.fault == fault)


def nothing_kept(lab, name: str, cache: Path | None) -> None:
    box = lab.box(name)
    dest = box_cache_path(RUNFILE)
    for path in (dest, dest + ".sha256", PREFIX, f"{MARKERS}/cuda.done"):
        assert not box.exists(path), f"{name}: {path} is there after a failed download"
    if cache is not None:
        local = controller_copy_path(cache, RUNFILE)
        assert not local.exists() and not local.with_name(local.name + ".sha256").exists()


MIRROR_FAULTS = {
    # fault: (relay message, direct message, tries relay, tries direct)
    "500": ("relay download of cuda_runfile failed on the controller: download of {url} failed after 3 tries",
            "download failed: {url} (partial file kept for resume)", 3, 4),
    "html": ("relay download of cuda_runfile failed on the controller: {url} answered an HTML page",
             "{url} answered an HTML page (Content-Type text/html", 1, 1),
}


@pytest.fixture(scope="module")
def mirror_boxes(lab):
    """A fresh relay box, a fresh direct box, and a bystander whose CUDA is already installed."""
    names = boot(lab, [BoxSpec("mirr", gpu="t4"), BoxSpec("mird", gpu="p40"), BoxSpec("mirok", gpu="t4")])
    run(lab, ("deploy/cuda.py",), ["mirok"], data_for(lab)).assert_ok()
    yield names[:2]
    shut(lab, names)


@pytest.mark.parametrize("fault", sorted(MIRROR_FAULTS))
@pytest.mark.parametrize("mode", ["relay", "direct"])
def test_mirror_error_fails_clearly_and_keeps_nothing(lab, mirror_boxes, fault, mode):
    name = dict(zip(("relay", "direct"), mirror_boxes, strict=True))[mode]
    cache = lab.dir / f"controller-cache-mirror-{fault}-{mode}"
    path = url_path(RUNFILE)
    url = lab.mirror_url + path
    relay_msg, direct_msg, relay_tries, direct_tries = MIRROR_FAULTS[fault]
    message = (relay_msg if mode == "relay" else direct_msg).format(url=url, size=overrides(lab)[RUNFILE]["size"])
    lab.mirror.reset_counters()
    with lab.mirror.faulty(fault, prefix=path):
        res = run(lab, ("deploy/cuda.py",), [name, "mirok"],
                  data_for(lab, artifact_mode=mode, controller_cache=str(cache)))
    # the box that needs the file fails; the bystander (nothing to fetch) runs to the end
    assert res.ran_operations, f"the run stopped before any operation, for every host:\n{res.tail(40)}"
    assert res.failed_hosts == [name], res.tail(40)
    assert message in res.output, res.tail(40)
    assert faulted(lab, path, fault) == (relay_tries if mode == "relay" else direct_tries), lab.mirror.requests
    nothing_kept(lab, name, cache if mode == "relay" else None)


def test_stalled_mirror_is_retried_and_both_modes_converge(lab, mirror_boxes):
    """The first request of each mode stalls (headers, then no body): the controller's read
    timeout and the box's curl --speed-time end it within a minute, the retry gets the file."""
    per_host = dict(zip(mirror_boxes, ({"artifact_mode": "relay"}, {"artifact_mode": "direct"}), strict=True))
    path = url_path(RUNFILE)
    data = data_for(lab, controller_cache=str(lab.dir / "controller-cache-mirror-stall"))
    lab.mirror.reset_counters()
    started = time.monotonic()
    with lab.mirror.faulty("stall", prefix=path, times=2):
        res = run(lab, ("deploy/cuda.py",), mirror_boxes, data, per_host)
        stalled_both = lab.mirror.fault is None        # both stalls were handed out (times=2 used up)
    took = time.monotonic() - started
    assert res.ok, res.tail(60)
    assert stalled_both
    # a stalled request is logged only when the mirror lets go of it (after stall_s); the
    # retries are logged at once: exactly one per mode
    retries = [r for r in lab.mirror.requests if r.path == path and r.fault is None and r.method == "GET"]
    assert len(retries) == 2 and all(r.status in (200, 206) for r in retries), retries
    assert 55 < took < 200, f"the stalls were not cut short after the read timeout: {took:.0f}s"
    for name in mirror_boxes:
        assert proven_markers(lab, name, overrides(lab)) == {"cuda"}
        assert not lab.box(name).exists(box_cache_path(RUNFILE) + ".part")
    run(lab, ("deploy/cuda.py",), mirror_boxes, data, per_host).assert_idempotent()


# ------------------------------------------------------------------ 4. one bad box among good ones

def test_bad_boxes_fail_alone_with_their_reason(lab):
    """Six boxes in one run of the cheap stages: a driver too old for CUDA 11.8, an install
    tmpdir on a 64 MiB tmpfs, no GPU (no driver at all); the three others finish every stage."""
    names = boot(lab, [BoxSpec("good1", gpu="t4"), BoxSpec("good2", gpu="rtx3090"), BoxSpec("good3", gpu="a100"),
                       BoxSpec("olddrv", gpu="p40", driver="470.82.01"), BoxSpec("tinydisk", gpu="t4"),
                       BoxSpec("nogpu", driver=None)], data_env=True)
    lab.box("tinydisk").ssh("mkdir -p /mnt/tiny && mount -t tmpfs -o size=64m tmpfs /mnt/tiny")
    per_host = {"good2": {"artifact_mode": "direct"}, "tinydisk": {"install_tmpdir": "/mnt/tiny/tmp"}}
    res = run(lab, CHEAP, names, data_for(lab), per_host)
    assert res.failed_hosts == sorted(FLEET_BAD), res
    lines = res.output.splitlines()
    for name, reason in FLEET_BAD.items():
        assert any(f"[{name}]" in line and reason in line for line in lines), f"{name}: no '{reason}'\n{res.tail(80)}"
        assert proven_markers(lab, name, overrides(lab)) == set(), f"{name} has markers after failing"
    for name in FLEET_GOOD:
        assert proven_markers(lab, name, overrides(lab)) == {"cuda", "data", "train"}, name
    run(lab, CHEAP, FLEET_GOOD, data_for(lab), per_host).assert_idempotent()
    shut(lab, names)


# ------------------------------------------------------------------ 5. the env broken four ways

ENV = test_env.ENV
ENVS = os.path.dirname(ENV)          # where its generations live (verl.gen1, verl.gen2, ...)
PATCH_0001 = f"{LAB_ROOT}/patches/verl-0.5.0/0001-autocast-dtype-follows-param-dtype.diff"


@pytest.fixture(scope="module")
def env_drill_lab(env_lab):
    """test_env's lab, shared (tests/e2e/conftest.py ``env_lab``: its boxes, its stand-ins, its
    deploy helper), with the env stage converged on its P40 box: after tests/e2e/test_env.py a
    run that changes nothing, else (this class alone) the first converge."""
    test_env.deploy(env_lab, hosts=[test_env.BOX]).assert_ok()
    return env_lab


def health(lab, quick: bool = False) -> dict:
    """The PythonEnv fact the env stage decides from: its own command, run on the box, and its
    own parser; ``quick``: the stage's re-check of a converged env (nothing imported)."""
    fact = PythonEnv()
    expect = {"torch": "2.13.0", "cuda": "none", "gpu_cc": "6.1", "vllm": None,
              "vllm_skip": "compute capability 6.1 < 7.0", "verl": "0.5.0", "verl_src": test_env.VERL_SRC,
              "compose": True, "overrides": [], **({"quick": True} if quick else {})}
    out = test_env.ssh(lab, fact.command(prefix=ENV, expect=expect)).stdout
    return fact.process(out.splitlines())


def env_python(lab, code: str) -> str:
    return test_env.ssh(lab, f"cd / && {test_env.PY} -c {json.dumps(code)}").stdout.strip()


class TestEnvDrill:
    """Drill 5, on the env lab test_env.py converged (``env_lab``, a pytest-xdist work unit with
    tests/e2e/test_env.py, apart from drills 1-4: tests/e2e/shared_labs.py): its one box, a P40."""

    def test_env_broken_four_ways_is_named_and_rebuilt_and_the_old_one_kept(self, env_drill_lab):
        """An Apex extension deleted, a verl patch reverted, verl's install removed, torch uninstalled: the
        PythonEnv fact names each; one deploy/rebuild.py builds a new generation (its summary line per host),
        proven, the old one kept as .prev and on disk; the stage then has nothing to do."""
        lab = env_drill_lab
        # healthy to start with: the proofs its build ran on this generation, and the quick re-check now
        # (what breaks in place; the full proofs after the first break show every other check still passing)
        assert test_env.built_proof(lab)["healthy"] and health(lab, quick=True)["healthy"]
        before = test_env.link(lab, ENV)
        # 1. an Apex extension deleted
        ext = env_python(lab, "import amp_C; print(amp_C.__file__)")
        test_env.ssh(lab, f"rm -f {ext}")
        h = health(lab)
        # the proof names it, and so does the RECORD check of the installed files
        assert h["broken"] == ["apex", "files"], h
        assert "amp_C" in h["checks"]["apex"]["detail"]
        assert "amp_C" in h["checks"]["files"]["detail"], h["checks"]["files"]
        # 2. a project patch reverted in the verl checkout
        test_env.ssh(lab, f"git -C {test_env.VERL_SRC} apply -R {PATCH_0001}")
        h = health(lab)
        assert "verl" in h["broken"] and "apex" in h["broken"], h
        assert "autocast_dtype_of" in h["checks"]["verl"]["detail"], h["checks"]["verl"]
        # 3. verl's install removed from the env
        test_env.ssh(lab, f"{test_env.PY} -m pip uninstall -y -q verl")
        h = health(lab)
        assert {"apex", "verl", "compose"} <= set(h["broken"]), h
        assert "No module named 'verl'" in h["checks"]["verl"]["detail"], h["checks"]["verl"]
        # 4. torch uninstalled
        test_env.ssh(lab, f"{test_env.PY} -m pip uninstall -y -q torch")
        h = health(lab)
        assert not h["healthy"] and "torch" in h["broken"], h
        assert "No module named 'torch'" in h["checks"]["torch"]["detail"], h["checks"]["torch"]
        # the marker still names the old generation: the stage decides from the fact, not the marker
        assert test_env.marker(lab)["generation"] == before

        res = test_env.deploy(lab, "deploy/rebuild.py", hosts=[test_env.BOX]).assert_ok()
        # its line per host (tasks/run_summary.py), as deploy/full.py's (issue 44)
        assert re.search(rf"^verl-lab: {test_env.BOX} \(1 x Tesla P40, from nvidia-smi\): base proven, env changed "
                         r"\d+; changed \d+ operations?; plan none; unit untouched", res.output, re.M), res.tail()
        after = test_env.link(lab, ENV)
        assert after.startswith("verl.gen") and after != before, after
        # the old generation is .prev and kept on disk
        assert test_env.link(lab, f"{ENV}.prev") == before and lab.box(test_env.BOX).exists(f"{ENVS}/{before}")
        # proven: the proofs the rebuild ran on this generation before it swapped it in (the same program as the
        # fact, on the same files: asked again it would import torch and verl once more for the same answer)
        p = test_env.built_proof(lab)
        assert p["healthy"], p
        assert test_env.marker(lab)["generation"] == after
        test_env.ssh(lab, f"git -C {test_env.VERL_SRC} apply -R --check {PATCH_0001}")    # applied again
        # the stage itself now finds a healthy env built from its plan: nothing to do
        test_env.deploy(lab, hosts=[test_env.BOX]).assert_idempotent()

    def test_killed_rebuild_leaves_the_old_env_working(self, env_lab):
        """deploy/rebuild.py killed while pip fills the new generation: the env link, the marker
        and the env itself are as they were; the next run of the stage has nothing to do."""
        lab = env_lab
        current = test_env.link(lab, ENV)
        marker = test_env.marker(lab)
        nxt = f"{ENV}.gen{int(current.rsplit('gen', 1)[1]) + 1}"
        state = {"last": 0.0, "since": None}

        def filling(line):
            now = time.monotonic()
            if state["since"] is None and now - state["last"] > 1.0:
                state["last"] = now
                probe_cmd = f"ls -d {nxt}/lib/python3*/site-packages/torch 2>/dev/null"
                if test_env.ssh(lab, probe_cmd, check=False).stdout.strip():
                    state["since"] = now
            return state["since"] is not None and now - state["since"] > 2.0

        data = {"mirror_urls": {**lab.mirror_urls, "pypi": env_standin.pypi_base(lab.mirror_url)},
                "catalog_overrides": lab.pyenv_overrides, "env_backend": "venv", "venv_python": "python3"}
        killed = run(lab, ("deploy/rebuild.py",), [test_env.BOX], data, trigger=filling, timeout=600)
        assert isinstance(killed, Killed) and state["since"] is not None, "the rebuild was not caught filling its env"
        assert lab.box(test_env.BOX).exists(nxt), "no half-built generation: the kill came too late"
        assert test_env.link(lab, ENV) == current
        assert test_env.marker(lab) == marker
        assert health(lab)["healthy"]
        test_env.deploy(lab, hosts=[test_env.BOX]).assert_idempotent()
