"""The doctor names every full disk: the checkpoint folder, the export, Ray's temp, Hugging Face
downloads, the env, pip and conda, a stage's own disk check, /dev/shm, and any other ENOSPC,
never "no rule matched".

Three kinds of text: the libraries' messages made for real here on full tmpfs folders (root: a
mount namespace of its own; tests/fixtures/doctor/full_disk.py: Python's OSError, safetensors, pip,
huggingface_hub, verl-lab's own download, torch's writer and shared memory;
tests/fixtures/doctor/verl_save_full_disk.py: verl 0.5.0's own checkpoint save and model merger),
a real Ray 2.46.0 run recorded once (tests/fixtures/doctor/ray_full_disk.py), and excerpts for what
cannot run here (conda, Ray's raylet.out-only and object-store lines) quoted from the releases'
source as cited in files/doctor/disk.toml. Each log ends with its full disk and must get its
place's rule alone; each pattern, near, unless and yields_to of the disk rules is needed by some
log (a mutation of any fails test_every_part_of_each_disk_rule_is_needed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tasks.doctor import diagnose, load_rules, render

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "doctor"
DISK_RULES = ("checkpoint-disk-full", "checkpoint-files-disk-full", "export-disk-full", "ray-temp-disk-full",
              "ray-object-store-full", "hf-download-disk-full", "env-disk-full", "pip-disk-full", "conda-disk-full",
              "stage-disk-short", "shm-full", "disk-full")
ESC = "\x1b"
WORKER = f"{ESC}[36m(WorkerDict pid=2000, ip=10.0.0.6){ESC}[0m "      # Ray's prefix for an actor's lines
TASK_RUNNER = f"{ESC}[36m(TaskRunner pid=1840){ESC}[0m "
SESSION = "session_2026-12-04_13-40-02_123456_1840"
EXPORT_CMD = ("verl-lab export: $ /opt/verl-lab/envs/verl/bin/python -m verl.model_merger merge --backend fsdp "
              "--local_dir /opt/verl-lab/train/checkpoints/global_step_20/actor --target_dir "
              "/opt/verl-lab/train/checkpoints/global_step_20/.hf.partial")
SAVE_FRAMES = (  # verl 0.5.0 fsdp_checkpoint_manager.py's save_checkpoint, as a worker prints it
    f"{WORKER}Traceback (most recent call last):\n"
    f'{WORKER}  File "/opt/verl-lab/src/verl/verl/utils/checkpoint/fsdp_checkpoint_manager.py", line 337, in save_checkpoint\n'
    f"{WORKER}    save_model.save_pretrained(hf_local_path, state_dict=state_dict)\n")

# log -> the findings it must give, exactly (one excerpt per pattern where a rule has several)
LOGS: dict[str, tuple[str, list[str]]] = {
    f.name: (f.read_text(), [f.name.removesuffix(".log")])
    for f in sorted(FIXTURES.glob("*.log")) if not f.name.endswith(".not.log")
    and f.name.removesuffix(".log") in DISK_RULES}
LOGS.update({
    # a cluster run's console: the head's and a worker's raylet under Ray's "(raylet, ip=A)" prefixes, the
    # TaskRunner's OutOfDiskError in the driver's RayTaskError (texts of the real run above, Ray 2.46's)
    "ray: a cluster, under Ray's prefixes": ((FIXTURES / "ray-temp-disk-full.cluster.txt").read_text(),
                                             ["ray-temp-disk-full"]),
    "export: Python's OSError": (
        EXPORT_CMD + "\n  File \"/opt/verl-lab/src/verl/verl/model_merger/base_model_merger.py\", line 289, in "
        "save_hf_model_and_tokenizer\nOSError: [Errno 28] No space left on device: "
        "'/opt/verl-lab/train/checkpoints/global_step_20/.hf.partial/tokenizer.json'", ["export-disk-full"]),
    "checkpoint hf_model: safetensors": (
        SAVE_FRAMES + f"{WORKER}safetensors._safetensors_rust.SafetensorError: Error while serializing: I/O error: No "
        "space left on device (os error 28)", ["checkpoint-files-disk-full"]),
    "a Ray log written while a save fails": (
        SAVE_FRAMES + f"{WORKER}OSError: [Errno 28] No space left on device: '/tmp/ray/{SESSION}/logs/worker-3f65.err'",
        ["ray-temp-disk-full"]),
    "ray: spilling failed (raylet)": (
        "[2026-12-04 13:52:11,402 I 1900 1900] (raylet) local_object_manager.cc:NNN: Failed to spill objects: "
        "IOError: [Errno 28] No space left on device", ["ray-temp-disk-full"]),
    "ray: the IO worker's error": (
        f"{TASK_RUNNER}An unexpected internal error occurred while the IO worker was spilling objects: [Errno 28] "
        "No space left on device", ["ray-temp-disk-full"]),
    "ray: a cluster node's spill folder": (
        f"{WORKER}OSError: [Errno 28] No space left on device: '/opt/verl-lab/ray/tmp/{SESSION}/ray_spilled_objects/"
        "f.bin'", ["ray-temp-disk-full"]),
    "hf: huggingface_hub's warning alone": (
        "/opt/verl-lab/envs/verl/lib/python3.10/site-packages/huggingface_hub/file_download.py:805: UserWarning: Not "
        "enough free disk space to download the file. The expected file size is: 988.10 MB. The target location "
        "/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct.staging only has 0.00 MB free disk space.",
        ["hf-download-disk-full"]),
    "hf: snapshot_download's failure (hf_snapshot.py's words)": (
        "verl-lab data: Qwen/Qwen2.5-0.5B-Instruct from https://huggingface.co: download failed ([Errno 28] No space "
        "left on device); completed files are kept in /opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct.staging and "
        "the next run continues. Fix: retry, or set mirror_profile = 'cn'", ["hf-download-disk-full"]),
    "hf: the training unit's HF_HOME": (
        f"{WORKER}OSError: [Errno 28] No space left on device: '/opt/verl-lab/train/cache/huggingface/datasets/"
        "parquet/default-1a2b/0.0.0/cache-3c4d.arrow'", ["hf-download-disk-full"]),
    "checkpoint: torch 2.13's text (as made on a full tmpfs here)": (
        "".join(f"{WORKER}{line}\n" for line in (
            'Traceback (most recent call last):',
            '  File "/opt/verl-lab/envs/verl/lib/python3.10/site-packages/torch/serialization.py", line 834, in __exit__',
            '    self.file_like.write_end_of_file()',
            'RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726')),
        ["checkpoint-disk-full"]),
    "checkpoint: torch's older writer text": (
        f"{WORKER}RuntimeError: [enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing file "
        "data/37: file write failed", ["checkpoint-disk-full"]),
    "ray: the raylet's disk monitor alone": (
        f"{ESC}[36m(raylet){ESC}[0m [2026-12-04 13:52:11,402 E 1900 1931] (raylet) file_system_monitor.cc:116: "
        f"/tmp/ray/{SESSION} is over 95% full, available space: 0.912354 GB; capacity: 19.5518 GB. Object creation "
        "will fail if spilling is required.", ["ray-temp-disk-full"]),
    "ray: its log sink": (
        "[*** LOG ERROR #0001 ***] [2026-12-05 04:52:29] [ray_log_sink] Failed flush to file /tmp/ray/session_2026-"
        "12-05_04-52-08_785724_21057/logs/python-core-driver-01000000ffffffffffffffffffffffffffffffffffffffffffffffff_"
        "21057.log: No space left on device", ["ray-temp-disk-full"]),
    "ray: OutOfDiskError alone": (
        "ray.exceptions.OutOfDiskError: Local disk is full\nThe object cannot be created because the local object "
        "store is full and the local disk's utilization is over capacity (95% by default).Tip: Use `df` on this "
        "node to check disk usage and `ray memory` to check object store memory usage.", ["ray-temp-disk-full"]),
    "hf: hf_snapshot's cut download alone": (
        "verl-lab data: download of https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/resolve/7ae5576/model."
        "safetensors was cut at 1048576 of 988097824 bytes ([Errno 28] No space left on device); the partial file "
        "/opt/verl-lab/models/Qwen--Qwen2.5-0.5B-Instruct.staging/.parts/model.safetensors.part is kept and the next "
        "run resumes it", ["hf-download-disk-full"]),
    "env: a file written into the new generation": (
        "OSError: [Errno 28] No space left on device: '/opt/verl-lab/envs/verl.gen2/lib/python3.10/site-packages/"
        "torch/__pycache__/__init__.cpython-310.pyc'", ["env-disk-full"]),
    "conda, Miniforge's create": ("\nNoSpaceLeftError: No space left on devices.\n", ["conda-disk-full"]),
    "conda: its package cache named": (
        "[Errno 28] No space left on device: '/opt/verl-lab/miniforge3/pkgs/python-3.10.16-he725a3c_1_cpython/lib/"
        "libpython3.10.so.1.0'", ["conda-disk-full"]),
    "a DataLoader worker's shared memory (torch 2.13's text, made on a 1 MiB /dev/shm here)": (
        f"{TASK_RUNNER}RuntimeError: unable to allocate shared memory(shm) for file </torch_4179_69093763_0>: No space "
        "left on device (28)", ["shm-full"]),
    "the data stage's own check (as deploy/data.py printed it in tests/e2e/test_doctor_disk.py)": (
        "    [directbox] verl-lab data: not enough free disk on /opt/verl-lab/models for Qwen/Qwen2.5-0.5B-Instruct@"
        "c00bc09078d6 and openai/gsm8k@5571f88ea720: 1 MiB free, 512 MiB needed; free space there or set lab_root to "
        "a larger filesystem", ["stage-disk-short"]),
    "the CUDA stage's own check": (
        "verl-lab cuda: not enough free disk on /var/tmp (tmpfs): 4000 MiB free, 10240 MiB needed (/var/tmp/verl-lab: "
        "10240 MiB for the runfile to unpack). Free some space, or point install_tmpdir / cuda_prefix / lab_root at a "
        "filesystem with room.", ["stage-disk-short"]),
    "tar on a full disk": ("tar: ./data/gsm8k/train.parquet: Cannot write: No space left on device", ["disk-full"]),
})


def findings(text: str, rules=None) -> list[str]:
    return [f.rule for f in diagnose("box", {"journal": text}, rules=rules).findings]


@pytest.mark.parametrize("name", sorted(LOGS))
def test_a_log_that_ends_in_a_full_disk_gets_its_places_rule_alone(name):
    text, expected = LOGS[name]
    diag = diagnose("box", {"journal": text})
    assert [f.rule for f in diag.findings] == expected
    assert diag.failed and "no rule matched" not in render(diag)


@pytest.mark.parametrize("prefix", [WORKER, f"{ESC}[36m(pid=2345, ip=10.0.0.6){ESC}[0m ", TASK_RUNNER, ""])
def test_a_ray_prefixed_repeat_of_the_same_error_keeps_the_specific_rule(prefix):
    """The worker's line (under each of Ray's prefixes: an actor's, a task's, the TaskRunner's, none)
    names Ray's session folder; the driver repeats the error in its RayTaskError without the path
    (and far from any frame): the general rule yields."""
    worker = f"{prefix}OSError: [Errno 28] No space left on device: '/tmp/ray/{SESSION}/logs/worker-3f65.err'\n"
    repeat = ("ray.exceptions.RayTaskError(OSError): ray::WorkerDict.actor_rollout_generate_sequences() (pid=2000, "
              "ip=10.0.0.6, actor_id=3f653b9b10c3f0f70e39d87f01000000)\n" + "\n" * 100
              + f"{TASK_RUNNER}OSError: [Errno 28] No space left on device\n")
    assert findings(worker + repeat) == ["ray-temp-disk-full"]
    assert findings(repeat) == ["disk-full"]           # alone, the repeat says only that a disk filled
    ckpt = (FIXTURES / "checkpoint-files-disk-full.log").read_text()
    assert findings(ckpt + "\n" + ckpt.replace(WORKER, TASK_RUNNER)) == ["checkpoint-files-disk-full"]


def test_details_name_the_disk_and_what_was_needed():
    def details(name):
        (finding,) = diagnose("box", {"journal": LOGS[name][0]}).findings
        return finding.details

    ray = details("ray-temp-disk-full.log")          # Ray 2.46.0's own run on a 160 MiB tmpfs
    assert ray["path"] == "/tmp/ray/session_2026-12-05_04-52-08_785724_21057" and ray["threshold_percent"] == 95.0
    assert ray["available_gb"] == 0.0 and ray["capacity_gb"] == 0.15625
    ray = details("ray: a cluster, under Ray's prefixes")
    assert ray["path"] == f"/opt/verl-lab/ray/tmp/{SESSION}" and ray["available_gb"] == 1.2e-05
    hf = details("hf-download-disk-full.log")
    assert hf["needs_at_least_bytes_more"] == 988097824 - 1048576 and hf["path"].endswith(".part")
    assert "941.3 MiB more" in hf["advice"]
    assert details("hf: huggingface_hub's warning alone").items() >= {"file_bytes": 988100000, "free_bytes": 0}.items()
    assert details("ray-object-store-full.log")["object_bytes"] == 4294967296
    assert details("env-disk-full.log")["path"].startswith("/opt/verl-lab/envs/verl.gen2/lib/")
    assert details("pip-disk-full.log") == {"env_generation_being_built": "/opt/verl-lab/envs/verl.gen2"}
    assert details("disk-full.log")["path"] == "/srv/backup/run.log"       # a copy: the destination filled
    assert details("the CUDA stage's own check") == {"path": "/var/tmp", "free_mib": 4000, "needed_mib": 10240}


def test_the_export_and_the_checkpoint_give_the_plans_numbers():
    plan = {"checkpoints": {"save_bytes_this_box": 6 << 30, "keep": 2, "max_ckpt_to_keep": 3,
                            "export_bytes": 1 << 30, "disk_bytes_this_box": 19 << 30}}
    for name in ("export: Python's OSError", "checkpoint-files-disk-full.log"):
        (finding,) = diagnose("box", {"journal": LOGS[name][0]}, plan).findings
        assert finding.details["export_bytes"] == 1 << 30 and "keep = 1 needs 6.0 GiB less" in finding.details["advice"]
    (finding,) = diagnose("box", {"journal": LOGS["export: Python's OSError"][0]}, plan).findings
    assert finding.details["path"].endswith(".hf.partial/tokenizer.json")


def test_the_fixes_name_the_places_settings():
    rules = {r.id: r for r in load_rules()}
    assert "RAY_TMPDIR" in rules["ray-temp-disk-full"].fix and "<lab_root>/ray/tmp" in rules["ray-temp-disk-full"].fix
    assert "controller_cache" in rules["hf-download-disk-full"].fix
    assert "conda clean --all" in rules["conda-disk-full"].fix and "env_prefix" in rules["pip-disk-full"].fix
    assert "keep" in rules["export-disk-full"].fix and "train-launcher --export" in rules["export-disk-full"].fix


def test_yields_to_must_name_a_rule(tmp_path):
    (tmp_path / "rules.toml").write_text('[[rule]]\nid = "a"\nmatch = ["x"]\ncause = "c"\nfix = "f"\n'
                                         'yields_to = ["b"]\n')
    with pytest.raises(ValueError, match="a rule's yields_to names no rule: a -> b"):
        load_rules(folder=tmp_path)


# ------------------------------------------------------------------ every part of each rule is needed

def _parts(rule):
    for field in ("match", "near", "unless", "yields_to"):
        for i in range(len(getattr(rule, field))):
            yield field, i


def _without(rule, field, i):
    kept = getattr(rule, field)
    if field == "match":        # a pattern that matches nothing
        return dataclasses.replace(rule, match=kept[:i] + (re.compile(r"(?!)"),) + kept[i + 1:])
    return dataclasses.replace(rule, **{field: kept[:i] + kept[i + 1:]})


NOT_LOGS = {f.name: f.read_text() for f in sorted(FIXTURES.glob("*.not.log"))
            if f.name.removesuffix(".not.log") in DISK_RULES}


@pytest.mark.parametrize("rule_id", DISK_RULES)
def test_every_part_of_each_disk_rule_is_needed(rule_id):
    """Mutation check: each pattern of the rule made to match nothing, each near, unless and
    yields_to entry dropped: some log's findings change (or a look-alike gains the rule)."""
    rules = load_rules()
    at = next(i for i, r in enumerate(rules) if r.id == rule_id)
    for field, i in _parts(rules[at]):
        mutant = rules[:at] + [_without(rules[at], field, i)] + rules[at + 1:]
        changed = [n for n, (text, expected) in LOGS.items() if findings(text, mutant) != expected]
        changed += [n for n, text in NOT_LOGS.items() if n.removesuffix(".not.log") in findings(text, mutant)]
        assert changed, f"{rule_id}: its {field}[{i}] can go and no log notices"


# ------------------------------------------------------------------ the texts made for real

def _wheel(folder: Path, name: str, files: dict[str, bytes | str]) -> None:
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: verl-lab-test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.fixture(scope="module")
def real(verl_python, tmp_path_factory):
    """{case: what the library printed} from tests/fixtures/doctor/full_disk.py on a 1 MiB tmpfs
    and an inode-starved one, in a mount namespace of its own, with the CPU test env's python
    (torch, pip 25.1.1, huggingface_hub: the libraries whose messages the rules read)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a full tmpfs of its own: root only")
    python = verl_python
    tmp = tmp_path_factory.mktemp("full-disk")
    full, inodes, wheels = tmp / "full", tmp / "inodes", tmp / "wheels"
    for d in (full, inodes, wheels):
        d.mkdir()
    _wheel(wheels, "big", {"big/__init__.py": "", "big/data.bin": os.urandom(2 << 20)})
    _wheel(wheels, "many", {f"many/m{i:03d}.py": "x = 1\n" for i in range(60)})
    script = (f"mount -t tmpfs -o size=1m verl-lab-test-full {full} && "
              f"mount -t tmpfs -o size=16m,nr_inodes=24 verl-lab-test-inodes {inodes} && "
              "mount -t tmpfs -o size=1m verl-lab-test-shm /dev/shm && "
              f"{python} {FIXTURES / 'full_disk.py'} {full} {inodes} {REPO} {tmp / 'out.json'} {wheels}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return {k: v.replace(str(full), "/opt/verl-lab").replace(str(inodes), "/opt/verl-lab")
            for k, v in json.loads((tmp / "out.json").read_text()).items()}


# case -> (the context a lab run puts around it, the rule); {} is the library's text
REAL_CASES = {
    "safetensors-export": (EXPORT_CMD + "\n{}", "export-disk-full"),
    "torch-save": ("".join(f"{WORKER}{line}\n" for line in "{}".splitlines()), "checkpoint-disk-full"),
    "torch-shm": (WORKER + "{}", "shm-full"),
    "ray-spill-copy": (WORKER + "{}", "ray-temp-disk-full"),
    "ray-log-open": ("{}", "ray-temp-disk-full"),
    "plain-write": ("{}", "disk-full"),
    "hf-snapshot-cut": ("{}", "hf-download-disk-full"),
    "hub-space-warning": ("{}", "hf-download-disk-full"),
    "pip-no-path": ("{}", "pip-disk-full"),
    "pip-env-path": ("{}", "env-disk-full"),
}


@pytest.mark.parametrize("case", sorted(REAL_CASES))
def test_the_real_message_on_a_full_tmpfs_gets_its_places_rule(real, case):
    text = real[case]
    assert not text.startswith("SKIPPED"), f"{case}: {text} (the CPU test env lacks a library the case needs)"
    assert re.search("No space left on device|Not enough free disk space|unexpected pos", text), text
    context, rule = REAL_CASES[case]
    if case == "torch-save":       # every line under the worker's prefix
        log = "".join(f"{WORKER}{line}\n" for line in text.splitlines())
    else:
        log = context.replace("{}", text)
    diag = diagnose("box", {"journal": log})
    assert [f.rule for f in diag.findings] == [rule], log
    assert "no rule matched" not in render(diag)


def test_docs_name_every_disk_rule():
    """docs/refusals.md's full-disk table has a row for each rule (and no rule it does not have)."""
    doc = (REPO / "docs" / "refusals.md").read_text()
    section = doc.split("## The doctor on a full disk", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| ") and "`" in line]
    named = {rule for row in rows for rule in re.findall(r"`([a-z-]+)`", row[2])}
    assert named == set(DISK_RULES)


# ------------------------------------------------------------------ verl's own save on a full disk

@pytest.fixture(scope="module")
def verl_saves(verl_python, patched_verl_root, tmp_path_factory):
    """verl 0.5.0's FSDPCheckpointManager (with the project's patches, as the boxes run it) saving
    on CPU onto a 64 KiB tmpfs and onto one that holds the .pt files but not huggingface/, then its
    model merger exporting onto a 64 KiB tmpfs (tests/fixtures/doctor/verl_save_full_disk.py; about 30 s)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("full tmpfs folders of their own: root only")
    work = tmp_path_factory.mktemp("verl-save")
    out = work / "out.json"
    res = subprocess.run(["unshare", "-m", str(verl_python), str(FIXTURES / "verl_save_full_disk.py"), str(work),
                          str(out)], cwd=patched_verl_root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and out.is_file(), res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case,rule,frame", [("shards", "checkpoint-disk-full", "in save_checkpoint"),
                                             ("huggingface", "checkpoint-files-disk-full", "in save_checkpoint"),
                                             ("export", "export-disk-full", "in merge_and_save")])
def test_verls_own_save_and_merger_on_a_full_disk(verl_saves, case, rule, frame):
    """The saves as the worker prints them, under Ray's prefix; the export as the unit's launcher
    prints it (the merger also calls save_pretrained: the export's rule alone); with the plan, the
    numbers for the fix."""
    text = verl_saves[case]
    assert frame in text and re.search("unexpected pos|No space left on device", text), text
    log = text if case == "export" else "".join(f"{WORKER}{line}\n" for line in text.splitlines())
    plan = {"checkpoints": {"save_bytes_this_box": 6 << 30, "keep": 2, "max_ckpt_to_keep": 3,
                            "export_bytes": 1 << 30, "disk_bytes_this_box": 19 << 30}}
    diag = diagnose("box", {"journal": log}, plan)
    assert [f.rule for f in diag.findings] == [rule], log
    assert "keep = 1 needs 6.0 GiB less" in diag.findings[0].details["advice"]
    assert "no rule matched" not in render(diag)
