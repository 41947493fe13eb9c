"""Stage: the training plan, launcher and systemd unit of a box.

Plans for the host's GPU target (tasks/target.py: the box's GPUs, or host data ``gpu_override``,
e.g. for a build box without a GPU), makes the plan (``tasks.plan.make_plan``) and writes, under
``settings.train_dir``:

* ``plan.json``: every setting with its reason, the predicted peak memory, the overrides; its
  ``launch`` section is what the launcher reads (host, paths, GPU, predicted peak, vLLM's share
  and what it was sized from, the overrides each with its reason);
* ``train-launcher``: verl_lab_box/train_launcher.py as it is; ``--check`` is the preflight, a
  plain run execs ``verl.trainer.main_ppo`` in ``train_dir/work`` with plan.json's overrides;
* ``verl_lab_preflight.py``, ``verl_lab_after_run.py``: the launcher's parts, verl_lab_box/preflight.py
  (the preflight's checks) and after_run.py (whether the run finished, the export and scores after it);
* ``verl_lab_gpu.py``: verl_lab_box/gpu.py, which the preflight imports for its GPU readings;
* ``verl_lab_vllm_share.py``: verl_lab_box/vllm_share.py, vLLM's share arithmetic (the plan's own),
  with which the preflight sizes the share again for what other processes hold on the GPUs;
* ``verl_lab_checkpoints.py``: verl_lab_box/checkpoints.py, the preflight's checkpoint disk check;
* ``verl_lab_export.py``, ``verl_lab_export_proof.py``, ``verl_lab_lora_export.py``, ``verl_lab_score.py``:
  verl_lab_box/export.py (with its proof, export_proof.py, and a LoRA run's merge, lora_export.py) and gsm8k_score.py, which the
  launcher runs when a run finishes (the proven Hugging Face export, the GSM8K scores; plan.json's
  ``launch.evaluation`` from tasks/evaluation.py says how to score);
* ``train.env``: the unit's EnvironmentFile (0640 root:train_user, no secrets);
* ``/etc/systemd/system/verl-lab-train.service``: runs the launcher as ``settings.train_user``.

``settings.train_unit_state``: ``installed`` (not enabled; left running if it runs), ``enabled``
(default; starts on boot), ``started`` (enabled and running now), ``stopped`` (not enabled, and
stopped now: a running or crash-looping unit is stopped; a re-run keeps it so).

A box without a usable GPU (and no ``gpu_override``), one whose plan cannot fit, or one whose
disk under the checkpoint folder cannot hold the kept saves, the one being written and the
export (``checkpoint_disk_short``), fails this stage on that host only, with the reason, before
anything on it changes. Proofs: ``systemd-analyze verify`` of the unit, and
the launcher, run by the train user, reads plan.json and finds its launch section's overrides
equal to the plan's; then the marker. A re-run with the same plan changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import gevent
from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.operations import files, python, server, systemd

from tasks.doctor import diagnose, render
from tasks.facts.bundle import ask
from tasks.facts.disk import CheckpointDisk
from tasks.facts.files import Marker, PathStates, UnitState
from tasks.facts.logs import TrainingRun
from tasks.failure import fail_host
from tasks.hostdata import cluster_for
from tasks.placed import marker_command, place, rendered, wanted_dir, wanted_file
from tasks.plan import PlanError, TrainingPlan, Workload, workload_for
from tasks.run_summary import note_for
from tasks.settings import TRAIN_UNIT, LabSettings
from tasks.status import unit_summary
from tasks.target import HostTarget
from tasks.tracking import keys_for_box, run_name_of, tracking_paths, tracking_values, tracking_wanted
from tasks.validation import training_plan
from verl_lab_box.checkpoints import disk_need, need_words

TEMPLATES = Path(__file__).resolve().parent.parent / "files" / "templates"
BOX_PACKAGE = Path(__file__).resolve().parent.parent / "verl_lab_box"
LAUNCHER = BOX_PACKAGE / "train_launcher.py"
UNIT_TEMPLATE = TEMPLATES / "verl-lab-train.service.j2"
ENV_TEMPLATE = TEMPLATES / "train.env.j2"
GPU_MODULE = BOX_PACKAGE / "gpu.py"
VLLM_SHARE_MODULE = BOX_PACKAGE / "vllm_share.py"
CHECKPOINTS_MODULE = BOX_PACKAGE / "checkpoints.py"
LAUNCHER_PARTS = {"verl_lab_preflight.py": BOX_PACKAGE / "preflight.py",
                  "verl_lab_after_run.py": BOX_PACKAGE / "after_run.py"}
AFTER_RUN_PROGRAMS = {"verl_lab_export.py": BOX_PACKAGE / "export.py",
                      "verl_lab_export_proof.py": BOX_PACKAGE / "export_proof.py",
                      "verl_lab_lora_export.py": BOX_PACKAGE / "lora_export.py",
                      "verl_lab_score.py": BOX_PACKAGE / "gsm8k_score.py"}
UNIT_PATH = f"/etc/systemd/system/{TRAIN_UNIT}"
PREFLIGHT_PASSED = "verl-lab preflight passed on "      # the launcher prints it, then execs verl
MARKER_PLAN_KEYS = ("rollout", "train_dtype", "attn_implementation", "predicted_peak_mib")
GATHER_TIMEOUT_S = 600     # a cluster's gather: every node's listing and copies (checkpoints of a few GiB over Ray)
START_WAIT_S = 600          # the preflight asks the env's Python (torch, verl, NVML): tens of seconds


def training_workload(settings: LabSettings, flash_attn_installed: bool = False) -> Workload:
    return workload_for(settings, flash_attn_installed)


@dataclass(frozen=True)
class TrainingLayout:
    """Paths and rendering values of the stage for one host (pure)."""

    settings: LabSettings
    plan: TrainingPlan
    plan_source: str
    tracker_keys: dict = field(default_factory=dict, repr=False, compare=False)   # an online run's keys

    @property
    def train_dir(self) -> str:
        return self.settings.train_dir

    @property
    def work_dir(self) -> str:
        return f"{self.train_dir}/work"

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.train_dir}/checkpoints"

    @property
    def cache_dir(self) -> str:
        return f"{self.train_dir}/cache"

    @property
    def launcher(self) -> str:
        return f"{self.train_dir}/train-launcher"

    @property
    def env_file(self) -> str:
        return f"{self.train_dir}/train.env"

    @property
    def plan_file(self) -> str:
        return f"{self.train_dir}/plan.json"

    @property
    def home(self) -> str:
        return f"{self.settings.lab_root}/home"      # tasks/base.py's home of the train user

    def plan_json(self) -> str:
        return json.dumps({**self.plan.to_dict(), "host": self.settings.host, "plan_source": self.plan_source,
                           "launch": self.launch()}, indent=2, sort_keys=True) + "\n"

    def launch(self) -> dict:
        """plan.json's ``launch`` section: everything verl_lab_box/train_launcher.py reads."""
        s, gpu = self.settings, self.plan.gpu
        return {
            "host": s.host,
            "plan_source": self.plan_source,
            "gpu": {"name": gpu.name, "count": gpu.count, "memory_mib": gpu.memory_mib, "names": gpu.names},
            "predicted_peak_mib": int(self.plan.to_dict()["predicted_peak_mib"]),
            "predicted_host_ram_mib": int(self.plan.to_dict()["predicted_host_ram_mib"]),
            # of it: patch 0013's saved base weights through each HF rollout with LoRA (each rank its shard)
            "predicted_lora_merge_host_mib": int(self.plan.to_dict()["predicted_lora_merge_host_mib"]),
            # vLLM's share and what the launcher sizes it again from at start (None: the HF rollout)
            "vllm": self.plan.to_dict()["vllm"],
            "paths": {
                "train_dir": self.train_dir,
                "work_dir": self.work_dir,
                "checkpoint_dir": self.checkpoint_dir,
                "env_file": self.env_file,
                "env_python": s.env_python,
                "env_marker": s.marker("env"),
                "data_marker": s.marker("data"),
                "data_files": [self.plan_workload_file("train_files"), self.plan_workload_file("val_files")],
                "model_dir": s.model_dir,
            },
            "overrides": [{"override": o.text(), "why": o.why} for o in self.plan.overrides],
            **({"checkpoints": self.plan.checkpoints.launch(self.checkpoint_dir, self.plan.gpu.count)}
               if self.plan.checkpoints else {}),
            "evaluation": self.evaluation(),
            # a cluster run's end: the seconds the head's gather may take (verl_lab_box/cluster_gather.py)
            **({"gather_timeout_s": GATHER_TIMEOUT_S} if self.nnodes > 1 else {}),
        }

    def evaluation(self) -> dict:
        """How the launcher scores the base model and the export on GSM8K's test split (tasks/evaluation.py)."""
        from tasks.evaluation import evaluation_plan

        test_file = self.plan_workload_file("train_files").rsplit("/", 1)[0] + "/test.parquet"
        try:
            return evaluation_plan(self.plan, test_file).to_dict()
        except PlanError as exc:        # the launcher then says why it does not score
            return {"problem": str(exc)}

    def values(self) -> dict:
        s = self.settings
        tracked = tracking_values(s.tracking, s.lab_root, self.train_dir, run_name_of(self.plan.overrides),
                                  self.tracker_keys)
        return {
            "host": s.host,
            "plan": self.plan.to_dict(),
            "plan_source": self.plan_source,
            "overrides": [{"text": o.text(), "why": o.why} for o in self.plan.overrides],
            "train_dir": self.train_dir,
            "work_dir": self.work_dir,
            "checkpoint_dir": self.checkpoint_dir,
            "env_file": self.env_file,
            "plan_file": self.plan_file,
            "launcher": self.launcher,
            "launcher_python": s.launcher_python,
            "env_python": s.env_python,
            "env_prefix": s.env_prefix,
            "cuda_prefix": s.cuda_prefix,
            "env_marker": s.marker("env"),
            "data_marker": s.marker("data"),
            "data_files": [self.plan_workload_file("train_files"), self.plan_workload_file("val_files")],
            "model_dir": s.model_dir,
            "train_user": s.train_user,
            "home": self.home,
            "hf_home": f"{self.cache_dir}/huggingface",
            "unit_name": TRAIN_UNIT,
            "unit_state": s.train_unit_state,
            "read_write_paths": [self.work_dir, self.checkpoint_dir, self.cache_dir, f"-{self.home}",
                                 *tracked["tracking_paths"]],
            **tracked,
        }

    @property
    def nnodes(self) -> int:
        value = next((o.value for o in self.plan.overrides if o.key == "trainer.nnodes"), "1")
        return int(value) if str(value).isdigit() else 1

    def plan_workload_file(self, key: str) -> str:
        return next(o.value for o in self.plan.overrides if o.key == f"data.{key}")

    def digest(self) -> str:
        """Everything the box's files are made of: a changed input re-runs the proofs."""
        parts = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in (LAUNCHER, UNIT_TEMPLATE, ENV_TEMPLATE, GPU_MODULE, CHECKPOINTS_MODULE,
                           *LAUNCHER_PARTS.values(), *AFTER_RUN_PROGRAMS.values())}
        parts["values"] = json.dumps(self.values(), sort_keys=True, default=str)
        parts["plan.json"] = self.plan_json()
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def training_wanted(layout: TrainingLayout) -> list:
    """The folders and files the stage places (tasks/placed.py), in order: folders first."""
    values, user = layout.values(), layout.settings.train_user
    return [
        wanted_dir(layout.train_dir, mode="750", group=user),
        *(wanted_dir(path, f"Directory {path} (the train user's)", mode="750", user=user, group=user)
          for path in (layout.work_dir, layout.checkpoint_dir, layout.cache_dir)),
        wanted_file(layout.plan_file, "Training plan (plan.json)", layout.plan_json()),
        wanted_file(f"{layout.train_dir}/verl_lab_gpu.py", "GPU reader for the preflight", GPU_MODULE.read_bytes()),
        wanted_file(f"{layout.train_dir}/verl_lab_vllm_share.py", "vLLM share arithmetic for the preflight",
                    VLLM_SHARE_MODULE.read_bytes()),
        wanted_file(f"{layout.train_dir}/verl_lab_checkpoints.py", "Checkpoint disk check for the preflight",
                    CHECKPOINTS_MODULE.read_bytes()),
        *(wanted_file(f"{layout.train_dir}/{name}", f"Launcher part {name}", src.read_bytes())
          for name, src in LAUNCHER_PARTS.items()),
        wanted_file(layout.launcher, "Training launcher", LAUNCHER.read_bytes(), mode="750", group=user),
        *(wanted_file(f"{layout.train_dir}/{name}", f"After-run program {name}", src.read_bytes())
          for name, src in AFTER_RUN_PROGRAMS.items()),
        wanted_file(layout.env_file, "Training environment file", rendered(ENV_TEMPLATE, **values),
                    mode="640", group=user),
        wanted_file(UNIT_PATH, f"Unit {TRAIN_UNIT}", rendered(UNIT_TEMPLATE, **values)),
        *tracking_wanted(layout.settings.tracking, layout.settings.lab_root, layout.train_dir, user,
                         layout.tracker_keys),
    ]


def training_paths(settings: LabSettings) -> list[str]:
    """The paths of ``training_wanted``, known before the plan is made (asked in the stage's one
    bundle; tests/unit/test_placed.py checks the two agree)."""
    t = settings.train_dir
    return [t, f"{t}/work", f"{t}/checkpoints", f"{t}/cache", f"{t}/plan.json", f"{t}/verl_lab_gpu.py",
            f"{t}/verl_lab_vllm_share.py", f"{t}/verl_lab_checkpoints.py", *(f"{t}/{name}" for name in LAUNCHER_PARTS),
            f"{t}/train-launcher",
            *(f"{t}/{name}" for name in AFTER_RUN_PROGRAMS), f"{t}/train.env", UNIT_PATH,
            *tracking_paths(settings.lab_root, t, settings.tracking)]


def checkpoint_disk_short(layout: TrainingLayout, found: dict | None) -> str | None:
    """Why the box's disk under the checkpoint folder cannot take this run's saves and export
    (None: it can): the free disk there (the CheckpointDisk fact) against the kept saves, the one
    being written and the export (verl_lab_box/checkpoints.py disk_need, as the preflight checks)."""
    cp = layout.plan.checkpoints
    if cp is None:
        return None
    if not found:
        return f"could not measure the free disk for {layout.checkpoint_dir} (df printed nothing usable)"
    launch = cp.launch(layout.checkpoint_dir, layout.plan.gpu.count)
    need = disk_need(launch["save_bytes"], launch["max_saves"], launch["export_bytes"], launch["every"], found,
                     launch["saves_in_run"], launch["last_step"])
    return None if need["fits"] else need_words(need, layout.checkpoint_dir, cp.keep)


def _flash_attn(env_marker: dict | None) -> bool:
    return (env_marker or {}).get("flash_attn", "").lower() in ("1", "true", "yes")


@deploy("verl-lab training plan, launcher and unit")
def install_train(settings: LabSettings, gpu: HostTarget, cluster_targets: dict | None = None,
                  unit_changed_by: str | None = None):
    """Plan for the host's GPU target (in a Ray cluster: ``cluster_targets``, every member's, for
    tasks.plan.cluster_plan); launcher, env file, plan.json and the systemd unit; proofs; marker.
    ``unit_changed_by``: what changed the unit outside this stage in this run (tasks/undo.py: the cluster's
    drop-in removed), so a started unit is restarted with it."""
    # one command for all this stage reads (tasks/facts/bundle.py)
    marker_path = settings.marker("train")
    env_marker, marker, states, unit, disk = ask(
        (Marker, {"path": settings.marker("env"), "legacy": settings.legacy_marker("env")}), (Marker, {"path": marker_path}),
        (PathStates, {"paths": training_paths(settings)}), (UnitState, {"unit": TRAIN_UNIT}),
        (CheckpointDisk, {"path": f"{settings.train_dir}/checkpoints"}))
    if gpu.target is None:
        fail_host(name="Training plan needs a GPU", message=gpu.problem or "no GPU target", stage="train")
        return
    target, source = gpu.target, gpu.source
    try:      # the plan the checks before any change made (tasks/validation.py), with what the env has now
        plan = training_plan(settings, target, cluster_targets, _flash_attn(env_marker))
    except PlanError as exc:
        fail_host(name=f"Training plan for {target.count} x {target.name}", message=str(exc), stage="train")
        return
    cluster = cluster_for()
    layout = TrainingLayout(settings=settings, plan=plan, plan_source=source,
                            tracker_keys=keys_for_box(settings.tracking,
                                                      worker=bool(cluster) and cluster.role(settings.host) == "worker"))
    short = checkpoint_disk_short(layout, disk)
    if short:
        fail_host(name="Free disk for the checkpoints", message=short, stage="train")
        return
    user = settings.train_user
    digest = layout.digest()
    proven = bool(marker) and marker.get("digest") == digest
    if marker and not proven:
        # new inputs: the old marker goes first, so a run killed below never leaves it
        # beside files it did not prove
        files.file(name="Old training marker removed (re-proving)", path=marker_path, present=False)

    wanted = training_wanted(layout)
    unit_changed = place(wanted, states)[UNIT_PATH] is not None
    if unit_changed:
        systemd.daemon_reload(name="systemd reads the changed unit")
    changed_words = " (the changed unit)" if unit_changed else f" ({unit_changed_by})" if unit_changed_by else ""
    unit_changed = unit_changed or bool(unit_changed_by)

    state = settings.train_unit_state
    want_enabled, want_running = state in ("enabled", "started"), state == "started"
    unit = unit or UnitState.default()
    starts = want_running and (unit_changed or not unit["active"])
    stops = state == "stopped" and (unit["active"] or unit["crash_looping"])
    if unit_changed or unit["enabled"] != want_enabled:
        systemd.service(name=f"Unit {TRAIN_UNIT}: {'enabled' if want_enabled else 'disabled'}", service=TRAIN_UNIT,
                        enabled=want_enabled, running=None)     # starting and stopping are below
    if stops:
        # a running or crash-looping unit (activating (auto-restart)): `stop` ends both; a re-run finds
        # it inactive and disabled and queues nothing
        server.shell(name=f"Unit {TRAIN_UNIT}: stopped (train_unit_state=stopped; it was "
                          f"{'crash-looping' if unit['crash_looping'] else 'running'})",
                     commands=[f"systemctl stop {shlex.quote(TRAIN_UNIT)}"])
    if starts:
        # (re)start, whatever state the last run left: a unit that crash-looped into its start limit
        # is reset first. Whether it then trains is the wait's to say, below.
        u = shlex.quote(TRAIN_UNIT)
        server.shell(name=f"Unit {TRAIN_UNIT}: started" + changed_words,
                     commands=[f"systemctl reset-failed {u} 2>/dev/null || true; systemctl restart {u} || true"])
    if proven:
        host.noop(f"training launcher and unit already proven for {target.count} x {target.name}")
    else:
        q, summary = shlex.quote, plan.to_dict()
        server.shell(
            name="Prove the unit and the launcher",
            commands=[
                f"systemd-analyze verify {q(UNIT_PATH)}",
                f"runuser -u {q(user)} -- {q(settings.launcher_python)} {q(layout.launcher)} "
                "--print-overrides --against-plan >/dev/null",
                marker_command(marker_path, [("stage", "train"), ("digest", digest),
                                             ("gpu", f"{target.count} x {target.name}"), ("plan_source", source),
                                             *((k, summary[k]) for k in MARKER_PLAN_KEYS),
                                             ("launcher", layout.launcher), ("unit", TRAIN_UNIT), ("unit_state", state)]),
            ],
        )
    if starts:
        python.call(name=f"{TRAIN_UNIT} trains (past its preflight, at most {START_WAIT_S} s)",
                    function=wait_until_training, settings=settings, seconds=START_WAIT_S)


def wait_until_training(state, host, settings: LabSettings, seconds: float = START_WAIT_S, poll_s: float = 2.0) -> bool:
    """Execute time, after the stage started the unit: wait until its current run has passed the
    launcher's preflight (then verl runs). A run that stops in the preflight (the unit crash-loops
    in ``activating (auto-restart)`` or fails), or no pass within ``seconds``, fails this host
    with the doctor's verdict on the run's journal; the other hosts go on."""
    args = {"unit": TRAIN_UNIT, "markers": {}, "plan_path": f"{settings.train_dir}/plan.json",
            "launcher": f"{settings.train_dir}/train-launcher", "user": settings.train_user,
            "python": settings.launcher_python, "lines": 400}
    deadline, poll = gevent.get_hub().loop.now() + seconds, 0
    while True:
        poll += 1
        run = host.get_fact(TrainingRun, poll=poll, **args)
        unit_state, words = unit_summary(run["unit"], run.get("history", ""))
        if PREFLIGHT_PASSED in run["journal"]:
            host.log_styled(f"{TRAIN_UNIT}: past its preflight, training ({words})", log_func=logger.info)
            note_for(host.name, unit="started, training")
            return True
        stopped = unit_state not in ("running", "never-ran")
        if stopped or gevent.get_hub().loop.now() > deadline:
            why = f"{words}" if stopped else f"no preflight pass within {int(seconds)} s ({words})"
            # the run's summary line says what the unit does, not what was asked of it (tasks/run_summary.py)
            note_for(host.name, unit=f"{unit_state}, not training ({why})")
            diag = diagnose(host.name, {"journal": run["journal"]}, run["plan"], failed=True)
            host.log_styled(f"verl-lab train: {TRAIN_UNIT} did not start training: {why}\n"
                            + "\n".join(render(diag).splitlines()[1:]), fg="red", log_func=logger.error)
            return False
        gevent.sleep(poll_s)
