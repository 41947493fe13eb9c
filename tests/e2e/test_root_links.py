"""Root never follows what the training user controls (docs/architecture.md, "Security"), on a lab box: real
pyinfra over SSH as root, real systemd, the real train user ``verl`` planting links, FIFOs and names as it
could from inside a training run.

One box, converged once by deploy/train.py (base and train stages: the layout, the user, the unit), a
root-owned env link whose Python is the box's python3 (enough for the launcher's export on demand to start).
For each root operation of the list, in one module:

- where root works only root can change: ``verl`` cannot plant a link, or rename a folder, in ``lab_root``,
  ``train/``, ``markers/``, ``cache/`` or ``/var/tmp/verl-lab`` (the rows "only root-owned parents");
- the facts that read the checkpoint folder (CheckpointDisk: the run's checks and the train stage;
  RunExports: deploy/status.py and deploy/export.py), asked by pyinfra: a step folder that is a link to a
  root-only folder holding a save and a scored export, a base score that is a link to root's file, a tracker
  and a run record that are FIFOs: nothing of root's is read, nothing waits, deploy/status.py shows no score,
  deploy/status.py and deploy/doctor.py (whose fact runs the launcher's ``--check`` as ``verl``) end in seconds;
- deploy/export.py's export (the launcher's after-run: gather, export, score, pruning) runs as ``verl``: the
  step's lock file planted as a link to a root-owned file leaves that file as it was;
- NVIDIA's runfile (the CUDA stage) writes ``/tmp/cuda-installer.log`` as root: planted as a link by ``verl``
  over and over during the deploy, the link's target stays as it was (the runfile has a /tmp of its own);
- ``install_tmpdir`` (``/var/tmp/verl-lab``, under the sticky ``/var/tmp``) taken first by ``verl`` (a link to
  a root-only folder, then a folder of its own): the base stage refuses the box and does nothing there; taken
  over and over while the deploy runs (the rename race): whoever wins the name, root never writes through it.

The tracking path's rows are tests/e2e/test_tracking.py's (docs/tracking.md). Each test says the mutation that
makes it fail.
"""

from __future__ import annotations

import json
import shlex
import time

import pytest

from tests.lab import BoxSpec

BOX = "linkbox"
ROOT = "/opt/verl-lab"
TRAIN = f"{ROOT}/train"
CKPT = f"{TRAIN}/checkpoints"
TMPDIR = "/var/tmp/verl-lab"
SECRET = "/root/verl-lab-secret-step"        # root's, 0700: looks like step 7's save and its scored export
VICTIM = "/root/verl-lab-victim"             # root's file, 0600: what a planted link points at
VICTIM_DIR = "/root/verl-lab-victim-dir"     # root's folder, 0700
ENV = f"{ROOT}/envs/verl"


@pytest.fixture(scope="module")
def lab(lab_factory):
    return lab_factory([BoxSpec(BOX, gpu="t4")])


@pytest.fixture(scope="module")
def box(lab):
    lab.deploy("deploy/train.py", mode="text").assert_ok()
    box = lab.box(BOX)
    # the env the launcher's export runs with: root's, its python the box's own (the export program is standard
    # library until it calls verl's merger)
    box.ssh(f"mkdir -p {ENV}.gen1/bin && ln -sfn /usr/bin/python3 {ENV}.gen1/bin/python && ln -sfn verl.gen1 {ENV}")
    box.ssh(f"mkdir -p {SECRET}/actor {SECRET}/hf && head -c 4194304 /dev/zero > {SECRET}/actor/model_world_size_1_rank_0.pt"
            f" && printf m > {SECRET}/hf/model.safetensors"
            f" && printf '%s' '{json.dumps({'ok': True, 'files': [{'name': 'model.safetensors', 'bytes': 1}]})}'"
            f" > {SECRET}/hf.proof.json && printf '%s' '{json.dumps({'accuracy': 0.4242, 'rows': 4242})}'"
            f" > {SECRET}/hf.gsm8k.json && chmod -R go-rwx {SECRET}")
    return box


def as_verl(box, command: str, check: bool = True):
    return box.ssh(command, user="verl", check=check)


def fresh_checkpoints(box) -> None:
    """The checkpoint folder emptied (by root, not following links: find -P), as the train stage left it."""
    box.ssh(f"find {CKPT} -mindepth 1 -delete")


def test_where_root_works_only_root_can_change(box):
    """Rows "only root-owned parents": the folders root's stages, facts and markers write in. Mutations tried:
    the train folder placed 0770 (tasks/train.py ``training_wanted``): ``verl`` plants a link in it; the trackers'
    parent the train user's again (tasks/tracking/train.py ``tracking_wanted``): ``verl`` renames its
    tensorboard folder away (and could put a link to /etc where root's chown would follow it)."""
    for folder in (ROOT, TRAIN, f"{ROOT}/markers", f"{ROOT}/cache", f"{ROOT}/tracking", TMPDIR):
        mode, owner, _ = box.stat(folder)
        assert owner == "root" and int(mode, 8) & 0o022 == 0, (folder, mode, owner)
        planted = as_verl(box, f"ln -s /etc/shadow {folder}/planted", check=False)
        assert planted.returncode != 0 and "Permission denied" in planted.stderr, (folder, planted)
    moved = as_verl(box, f"mv {CKPT} {CKPT}.away", check=False)         # its own folder, in root's
    assert moved.returncode != 0 and "Permission denied" in moved.stderr
    assert box.stat(CKPT)[1] == "verl"
    # a tracker's folder too: root's train stage places it (mkdir, chmod, chown) by a name in root's folder
    moved = as_verl(box, f"mv {ROOT}/tracking/tensorboard {ROOT}/tracking/tensorboard.away", check=False)
    assert moved.returncode != 0 and "Permission denied" in moved.stderr
    assert box.stat(f"{ROOT}/tracking/tensorboard")[1] == "verl"


def test_the_facts_that_read_checkpoints_follow_no_link_and_wait_on_no_fifo(lab, box, tmp_path):
    """Mutations tried: ``as_folder_owner`` reading as root (no runuser): step 7's 4 MiB save and its 0.4242
    score (root's) come back, and deploy/status.py shows them; ``read_file`` as ``cat``: the tracker FIFO holds each
    fact until its 60 s timeout."""
    fresh_checkpoints(box)
    as_verl(box, f"mkfifo {CKPT}/latest_checkpointed_iteration.txt {CKPT}/run-finished.json && "
                 f"ln -s {SECRET} {CKPT}/global_step_7 && ln -s {SECRET}/hf.gsm8k.json {CKPT}/gsm8k-base.json")
    started = time.monotonic()
    probe = lab.deploy("tests/fixtures/checkpoint_facts_probe.py", mode="text", timeout=300)
    took = time.monotonic() - started
    probe.assert_ok()
    line = next(x for x in probe.output.splitlines() if x.startswith(f"CHECKPOINT-FACTS {BOX} "))
    found = json.loads(line.split(" ", 2)[2])
    disk, exports = found["disk"], found["exports"]
    assert disk["saves"] == [] and disk["exports"] == [] and disk["tracker"] is None, disk
    assert exports == {"latest_step": None, "finished_step": None, "base": None, "exports": []}, exports
    assert took < 50, f"the facts took {took:.0f} s: a read waited on a FIFO"
    out = tmp_path / "status.json"
    started = time.monotonic()
    status = lab.deploy("deploy/status.py", data={"status_json": str(out)}, mode="text", timeout=300)
    assert status.rc == 0, status.tail()
    (row,) = json.loads(out.read_text())["hosts"]
    assert row["gsm8k"]["base"] is None and row["gsm8k"]["trained"] is None, row["gsm8k"]
    # the doctor too: its fact runs the launcher's --check as verl (the unit never ran), which reads the folder
    doctor = lab.deploy("deploy/doctor.py", mode="text", timeout=300)
    assert doctor.rc == 0 and "never ran" in doctor.output, doctor.tail()
    took = time.monotonic() - started
    assert took < 120, f"status and the doctor took {took:.0f} s: a read waited on a FIFO"


def test_deploy_export_exports_as_the_train_user(lab, box):
    """The export on demand (deploy/export.py -> ``runuser -u verl -- train-launcher --export``) takes the step's
    lock first: the lock file is a link to a root-owned file, which ``verl`` cannot open. Mutation tried: the
    export run as root (deploy/export.py without runuser): root opens the link, truncates the file and writes its
    pid there."""
    fresh_checkpoints(box)
    box.ssh(f"printf 'untouched\\n' > {VICTIM} && chmod 600 {VICTIM}")
    as_verl(box, f"mkdir -p {CKPT}/global_step_5/actor && printf 5 > {CKPT}/latest_checkpointed_iteration.txt && "
                 f"printf '{{}}' > {CKPT}/global_step_5/actor/fsdp_config.json && "
                 f"ln -s {VICTIM} {CKPT}/global_step_5/.export.lock")
    res = lab.deploy("deploy/export.py", mode="text", timeout=600)
    assert box.read_text(VICTIM) == "untouched\n"
    assert box.stat(VICTIM) == ("600", "root", "root")
    assert res.failed_hosts == [BOX] and "Permission denied" in res.output, res.tail()   # verl cannot open root's


def planting(box, loop: str):
    """``loop`` run as ``verl`` in the background (its pid in a file of its home), ended by that pid."""
    pidfile = f"{ROOT}/home/planter.pid"
    box.ssh(f"nohup runuser -u verl -- sh -c {shlex.quote(f'echo $$ > {pidfile}; exec sh -c {shlex.quote(loop)}')}"
            " >/dev/null 2>&1 &")
    time.sleep(1)
    return lambda: box.ssh(f"kill $(cat {pidfile}) && rm -f {pidfile}")


def test_the_cuda_runfile_writes_no_log_through_a_planted_link(lab, box):
    """NVIDIA's runfile writes /tmp/cuda-installer.log as root (its stand-in, tests/fixtures/standins/cuda.py, does
    as the real one). ``verl`` plants that name as a link to a root-owned file again and again, from before the
    deploy until after it (root's ``rm -f`` of a stale log cannot win). The runfile runs with a /tmp of its own
    (tasks/cuda.py PRIVATE_TMP): the file stays as it was. Mutation tried: ``script_values(private_tmp=False)``:
    the stand-in empties root's file through the link (this kernel has fs.protected_symlinks=0)."""
    from tests.fixtures.standins import cuda as standin

    overrides = standin.publish(lab.mirror.root)
    box.ssh(f"printf 'untouched\\n' > {VICTIM} && chmod 600 {VICTIM}")
    stop = planting(box, f"while :; do ln -s {VICTIM} /tmp/cuda-installer.log 2>/dev/null; done")
    try:
        res = lab.deploy("deploy/cuda.py", data={"catalog_overrides": overrides}, mode="text")
    finally:
        stop()
        box.ssh("rm -f /tmp/cuda-installer.log")
    res.assert_ok()
    assert box.read_text(VICTIM) == "untouched\n" and box.stat(VICTIM) == ("600", "root", "root")
    assert box.exists("/var/log/cuda-installer.log")          # the runfile's own log, where it puts it


def _refused(res, words: str) -> None:
    assert res.failed_hosts == [BOX], res.tail()
    assert f"install_tmpdir = '{TMPDIR}'" in res.output and words in res.output, res.tail()


def test_an_install_tmpdir_someone_else_took_is_refused(lab, box):
    """``/var/tmp/verl-lab`` gone (systemd-tmpfiles ages /var/tmp out), then taken by ``verl``: a link to a
    root-only folder, then a folder of its own. Mutation tried: the base stage without its check of the folders
    root works in (``root_only_problem`` answering None): the deploy passes, root's later stages would work there."""
    box.ssh(f"rm -rf {TMPDIR} && mkdir -m 700 {VICTIM_DIR}")
    as_verl(box, f"ln -s {VICTIM_DIR} {TMPDIR}")
    _refused(lab.deploy("deploy/train.py", mode="text"), "is a link of uid")
    assert box.stat(VICTIM_DIR) == ("700", "root", "root") and box.ssh(f"ls -A {VICTIM_DIR}").stdout == ""
    box.ssh(f"rm {TMPDIR}")
    as_verl(box, f"mkdir -m 777 {TMPDIR}")
    _refused(lab.deploy("deploy/train.py", mode="text"), "belongs to uid")
    assert box.stat(TMPDIR)[1] == "verl"                     # left as it was: nothing chowned, nothing written
    box.ssh(f"rm -rf {TMPDIR}")
    lab.deploy("deploy/train.py", mode="text").assert_ok()   # the name free again: root makes it its own
    assert box.stat(TMPDIR) == ("755", "root", "root")


def test_an_install_tmpdir_planted_over_and_over_is_never_followed(lab, box):
    """The rename race: while the deploy runs, ``verl`` plants the link and removes it again as fast as it can.
    Root's check (prepare time) or its ``mkdir`` (execute time) loses or wins the name; either way nothing is
    written through the link. Mutation tried: the folder made with ``mkdir -p`` and no check after
    (``root_dir_command``): the race lands in tests/unit/test_root_only.py (200 rounds); here once, it may not."""
    box.ssh(f"rm -rf {TMPDIR} {VICTIM_DIR} && mkdir -m 700 {VICTIM_DIR}")
    stop = planting(box, f"while :; do ln -s {VICTIM_DIR} {TMPDIR} 2>/dev/null; rm -f {TMPDIR} 2>/dev/null; done")
    try:
        res = lab.deploy("deploy/train.py", mode="text")
    finally:
        stop()
    assert box.stat(VICTIM_DIR) == ("700", "root", "root") and box.ssh(f"ls -A {VICTIM_DIR}").stdout == ""
    if res.failed_hosts:
        assert f"install_tmpdir = '{TMPDIR}'" in res.output or "is not a folder of root's alone" in res.output, res.tail()
    else:
        assert box.stat(TMPDIR) == ("755", "root", "root")
    box.ssh(f"[ -L {TMPDIR} ] && rm -f {TMPDIR}; true")
