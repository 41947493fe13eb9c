"""Stage: the model and the dataset, mirrored through a Hugging Face endpoint, and GSM8K in
verl's RL format.

- The model (``settings.model_artifact``, default ``qwen_model``) and the dataset
  (``settings.dataset_artifact``, default ``gsm8k``) are catalog artifacts: repo, a pinned
  commit, and the ``files`` sizes / sha256 to check. A user may point them at another small
  model with ``catalog_overrides`` (repo / revision / files).
- The endpoint is the base URL of the catalog source ``huggingface`` under the host's mirror
  profile (``https://hf-mirror.com`` for ``cn``; ``mirror_urls.huggingface`` replaces it).
- ``relay`` mode: the controller downloads each snapshot once into
  ``controller_cache/hf/`` (progress bars, resume, verification: ``verl_lab_box/hf_snapshot.py``), then
  pushes the verified files to every box into a staging folder; the box re-checks every
  sha256 and only then swaps the folder in. Boxes need no internet and no Hub client.
- ``direct`` mode: each box runs the same program (as ``hfsnapshot.py``) with the env's python (which then
  needs ``huggingface_hub``; the env stage provides it), with ``HF_ENDPOINT`` set.
- GSM8K is converted on the box, in the env, by ``verl_lab_box/gsm8k.py`` (why there: see its
  docstring), into ``<data_dir>/{train,test,val_small}.parquet``.
- What the stage fetches and makes is decided first, from the settings alone
  (``tasks.data.plan.data_plan``, which the inventory pass also makes for every host).
- Proofs on the box, then the marker ``settings.marker("data")``; a re-run whose marker digest
  matches and whose files are present does nothing (zero changed operations).

An HF token (``hf_token_file``, else ``HF_TOKEN`` in the controller's environment) is used
in-process on the controller; in direct mode it is written on the box to
``<lab_root>/secrets/hf_token`` (folder 0700, file 0600, root) and read by the box-side script
from that file. It never appears in argv, logs or the marker.
"""

from __future__ import annotations

import json
import os
import shlex
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api import FileUploadCommand, StringCommand, deploy, operation
from pyinfra.operations import files, server

from tasks.data.plan import SCRIPTS, DataPlan, data_plan
from tasks.facts.bundle import ask
from tasks.facts.data import FilesPresent, PythonModules, SnapshotStamp, StagedFiles
from tasks.facts.disk import FreeDisk
from tasks.facts.files import Marker
from tasks.failure import fail_host
from tasks.placed import marker_command
from tasks.settings import LabSettings
from verl_lab_box import hf_snapshot as hfsnapshot  # hf_snapshot is this stage's operation below
from verl_lab_box.hf_snapshot import RepoSpec, SnapshotError

MIB = 1024 * 1024

def disk_shortfall(specs, disk, path: str) -> str | None:
    """What is wrong with the free disk at ``path`` for fetching ``specs`` (None: enough): the
    catalog's file sizes, 10% more for files it gives no size (tokenizers, configs), and 512 MiB."""
    if not specs:
        return None
    need = sum(int(f.get("size") or 0) for spec in specs for f in spec.files.values()) * 1.1 / MIB + 512
    if not disk:
        return f"could not measure free disk for {path} (df printed nothing usable)"
    if disk["free_mib"] < need:
        names = " and ".join(f"{s.repo}@{s.revision[:12]}" for s in specs)
        return (f"not enough free disk on {disk['mount']} for {names}: {disk['free_mib']} MiB free, {int(need)} MiB "
                f"needed; free space there or set lab_root to a larger filesystem")
    return None


# ---------------------------------------------------------------- controller side

def hf_token(settings: LabSettings) -> str | None:
    """The HF token from hf_token_file, else HF_TOKEN; never logged."""
    if settings.hf_token_file is not None:
        token = Path(settings.hf_token_file).read_text().strip()
        return token or None
    return os.environ.get("HF_TOKEN") or None


def controller_dir(settings: LabSettings, spec: RepoSpec) -> Path:
    return (settings.controller_cache / "hf" / f"{spec.repo_type}s" / spec.repo.replace("/", "--")
            / spec.revision)


def controller_snapshot(settings: LabSettings, spec: RepoSpec, endpoint: str) -> Path:
    """Fetch (once; resumable; verified) a snapshot into the controller cache; return its folder."""
    dest = controller_dir(settings, spec)
    hfsnapshot.fetch(spec, dest, endpoint, hf_token(settings), progress=True)
    return dest


# ---------------------------------------------------------------- box side

@operation(is_idempotent=True)
def hf_snapshot(settings: LabSettings, plan: DataPlan, spec: RepoSpec, dest: str, local: Path | None = None):
    """
    Put a verified snapshot of ``spec`` at ``dest`` on the box (relay: pushed; direct: fetched).

    + settings: the host's LabSettings
    + plan: the stage's DataPlan
    + spec: the snapshot (repo, pinned revision, files to check)
    + dest: the folder on the box
    + local: relay mode: the verified controller copy (``controller_snapshot``)

    **Example:**

    .. code:: python

        hf_snapshot(name="Model", settings=settings, plan=plan, spec=plan.model, dest=plan.model_dir)
    """
    stamp = host.get_fact(SnapshotStamp, dest=dest)
    if stamp and stamp.get("digest") == spec.digest:
        host.noop(f"{spec.label} already verified at {dest}")
        return
    q = shlex.quote
    spec_path = f"{plan.tools_dir}/{spec.artifact}.spec.json"
    yield from files.put._inner(src=StringIO(json.dumps(spec.to_json(), sort_keys=True)), dest=spec_path,
                                mode="644")
    script = f"{plan.tools_dir}/hfsnapshot.py"
    if plan.mode == "relay":
        local = local or controller_snapshot(settings, spec, plan.endpoint)
        manifest = hfsnapshot.read_stamp(local)["files"]
        staging = dest + ".staging"
        staged = host.get_fact(StagedFiles, path=staging)
        for name, info in sorted(manifest.items()):
            if staged.get(name) == info["sha256"]:
                continue
            target = f"{staging}/{name}"
            yield StringCommand("mkdir", "-p", q(target.rsplit("/", 1)[0]))
            yield FileUploadCommand(str(local / name), target)
        manifest_path = f"{plan.tools_dir}/{spec.artifact}.manifest.json"
        yield from files.put._inner(src=StringIO(json.dumps(manifest, sort_keys=True)), dest=manifest_path,
                                    mode="644")
        yield StringCommand(q(plan.env_python), q(script), "install", "--spec", q(spec_path), "--staging",
                            q(staging), "--dest", q(dest), "--manifest", q(manifest_path))
    else:
        args = [q(plan.env_python), q(script), "fetch", "--spec", q(spec_path), "--dest", q(dest)]
        token = hf_token(settings)
        token_path = f"{plan.secrets_dir}/hf_token"
        if token:
            yield from files.directory._inner(path=plan.secrets_dir, mode="700", user="root", group="root")
            yield from files.put._inner(src=StringIO(token + "\n"), dest=token_path, mode="600",
                                        user="root", group="root")
            args += ["--token-file", q(token_path)]
        yield StringCommand("env", q(f"HF_ENDPOINT={plan.endpoint}"), "HF_HUB_DISABLE_TELEMETRY=1",
                            "HF_HUB_DISABLE_PROGRESS_BARS=1", *args)


@deploy("verl-lab model and dataset")
def install_data(settings: LabSettings):
    """Model and GSM8K snapshots on the box, GSM8K in verl's format, proofs, then the marker."""
    plan = data_plan(settings)
    marker_path = settings.marker("data")
    marker, present = ask((Marker, {"path": marker_path}), (FilesPresent, {"paths": plan.proof_paths}))
    present = present or {}
    if marker and marker.get("digest") == plan.digest and all(present.get(p) is not None for p in plan.proof_paths):
        host.noop(f"model {plan.model.repo}@{plan.model.revision[:12]} and {plan.dataset.repo} data already proven")
        return

    mods = host.get_fact(PythonModules, python=plan.env_python, modules=plan.box_modules())
    if not mods or not all(mods.values()):
        # In deploy/full.py the env stage runs just before this one, so an env missing while
        # preparing may exist by the time these operations run: check when they run.
        need = ", ".join(plan.box_modules())
        why = (f"{plan.env_python} cannot import {need}; run the env stage first (the data stage runs "
               f"after it: it converts GSM8K with the env's pyarrow"
               + (", and downloads with its huggingface_hub in direct mode)" if plan.mode == "direct" else ")"))
        server.shell(
            name="Data stage needs the env",
            commands=[f"{shlex.quote(plan.env_python)} -c {shlex.quote('import ' + need)} 2>/dev/null || "
                      f"{{ echo {shlex.quote('verl-lab data: ' + why)} >&2; exit 1; }}"],
        )

    snapshots = ((plan.model, plan.model_dir, "Model"), (plan.dataset, plan.source_dir, "Dataset"))
    # free disk for what is still to come, before anything is fetched (a 3B model is 6 GB)
    stamps = {spec.artifact: host.get_fact(SnapshotStamp, dest=dest) for spec, dest, _ in snapshots}
    todo = [spec for spec, _, _ in snapshots
            if not (stamps[spec.artifact] and stamps[spec.artifact].get("digest") == spec.digest)]
    short = disk_shortfall(todo, host.get_fact(FreeDisk, path=plan.model_dir) if todo else None, plan.model_dir)
    if short:
        fail_host(name="Free disk for the model and data", message=short, stage="data")
        return
    local: dict[str, Path] = {}
    if plan.mode == "relay":
        # Controller downloads happen here, while preparing: a bad endpoint, repo or revision
        # fails this host with the message, before anything on the box changes.
        for spec, dest, _ in snapshots:
            stamp = host.get_fact(SnapshotStamp, dest=dest)
            if stamp and stamp.get("digest") == spec.digest:
                continue
            try:
                local[spec.artifact] = controller_snapshot(settings, spec, plan.endpoint)
            except (SnapshotError, OSError) as exc:
                fail_host(name=f"Fetch {spec.repo} on the controller", message=str(exc), stage="data")
                return

    files.file(name="Old data marker removed (re-proving)", path=marker_path, present=False)
    files.directory(name=f"Directory {plan.tools_dir}", path=plan.tools_dir, mode="755", user="root", group="root")
    for name, path in SCRIPTS.items():
        files.put(name=f"Box-side {name}", src=str(path), dest=f"{plan.tools_dir}/{name}", mode="644",
                  user="root", group="root")
    if plan.mode == "relay" or not hf_token(settings):
        files.file(name="No HF token kept on the box", path=f"{plan.secrets_dir}/hf_token", present=False)

    for spec, dest, what in snapshots:
        hf_snapshot(name=f"{what} {spec.repo} @ {spec.revision[:12]} ({plan.mode})", settings=settings,
                    plan=plan, spec=spec, dest=dest, local=local.get(spec.artifact))

    q = shlex.quote
    py, tools = q(plan.env_python), q(plan.tools_dir)
    server.shell(
        name="GSM8K in verl's RL format",
        commands=[f"{py} {tools}/gsm8k.py build --train {q(plan.source_dir + '/' + plan.train_file)} "
                  f"--test {q(plan.source_dir + '/' + plan.test_file)} --out {q(plan.data_dir)} "
                  f"--val-rows {plan.val_rows}"],
    )
    server.shell(
        name="Prove model and data",
        commands=[
            f"{py} {tools}/hfsnapshot.py prove --spec {tools}/{q(plan.model.artifact)}.spec.json "
            f"--dest {q(plan.model_dir)}",
            f"{py} {tools}/hfsnapshot.py prove --spec {tools}/{q(plan.dataset.artifact)}.spec.json "
            f"--dest {q(plan.source_dir)}",
            f"{py} {tools}/gsm8k.py prove --out {q(plan.data_dir)} --train-rows {plan.rows['train']} "
            f"--test-rows {plan.rows['test']} --val-rows {plan.val_rows}",
            marker_command(marker_path, [
                ("stage", "data"), ("digest", plan.digest), ("model_repo", plan.model.repo),
                ("model_revision", plan.model.revision), ("model_dir", plan.model_dir),
                ("dataset_repo", plan.dataset.repo), ("dataset_revision", plan.dataset.revision),
                ("data_dir", plan.data_dir), ("train_file", f"{plan.data_dir}/train.parquet"),
                ("test_file", f"{plan.data_dir}/test.parquet"), ("val_file", f"{plan.data_dir}/val_small.parquet"),
                ("train_rows", plan.rows["train"]), ("test_rows", plan.rows["test"]),
                ("val_rows", plan.rows["val_small"]), ("endpoint", plan.endpoint_shown),
                ("artifact_mode", plan.mode)]),
        ],
    )
