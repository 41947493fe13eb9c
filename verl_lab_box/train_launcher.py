#!/usr/bin/env python3
"""verl-lab training launcher: verl PPO on this box, as the box's plan says.

Shipped unchanged by tasks/train.py (from verl_lab_box/train_launcher.py) to
``<train_dir>/train-launcher``, beside the box's ``plan.json``, ``verl_lab_gpu.py`` (the GPU
reader, verl_lab_box/gpu.py), ``verl_lab_vllm_share.py`` (vLLM's share arithmetic,
verl_lab_box/vllm_share.py) and its two parts, which it loads and hands what they use of it
(``part``): ``verl_lab_preflight.py`` (the checks, verl_lab_box/preflight.py) and
``verl_lab_after_run.py`` (whether the run finished, the export and scores after it,
verl_lab_box/after_run.py). Everything it knows comes from plan.json's ``launch`` section:
host, paths, the planned GPU and predicted peak memory, vLLM's share and what it was sized from,
and the verl overrides each with its reason (``"overrides": [{"override": ..., "why": ...}]``).
Do not edit: re-run deploy/train.py.

Before a vLLM plan runs, the preflight sizes vLLM's share again for the GPUs as they are then
(``check_vllm_share``): what other processes hold on them, under the plan's engine's accounting,
and passes the share that keeps the plan's KV cache as the override (``--no-preflight`` runs the
plan's share as it is).

    train-launcher --check             preflight: GPU, driver, env, data, model; what it would run
    train-launcher --print-overrides   the Hydra overrides, one per line
                   [--against-plan]    ... and exit 1 unless they equal plan.json's ``overrides``
    train-launcher                     preflight, then verl.trainer.main_ppo as a child (the systemd unit);
                                       when verl exits 0 by itself, the run is finished: the latest actor
                                       checkpoint is exported and scored (``after_run``)
    train-launcher --no-preflight      run at once
    train-launcher --no-export         ... and do not export or score when it finishes
    train-launcher --export            export the latest checkpoint now (proven HF folder beside it) and
                   [--no-score]        score the base model and it on GSM8K (on demand; not final unless
                                       the run finished at that step)
    train-launcher [...] -- KEY=VALUE  extra Hydra overrides after the plan's (a run by hand,
                                       e.g. `-- trainer.total_training_steps=5 trainer.save_freq=-1`)
    train-launcher --plan PATH [...]   read another plan.json than the one beside the launcher
    train-launcher --burnin [--keep]   the burn-in (verl_lab_burnin.py, docs/burnin.md): a few steps of this plan in
                   [--no-preflight]    its own folder, a save, a resume and an export, judged; never beside the unit

Runs with the system's Python (standard library only; the systemd unit names the interpreter,
``settings.launcher_python``); the env's Python is asked about torch, verl and NVIDIA's NVML in
a child process (``--probe-env``).

A run ends in one of three ways. Stopped (SIGTERM from ``systemctl stop``, SIGINT, SIGHUP): the
signal goes on to verl and, once verl is gone, ends the launcher the same way: nothing is exported,
whatever verl's exit status. Failed (verl exits non-zero): the launcher exits with verl's status
(the unit's ``Restart=on-failure`` resumes from the last checkpoint). Finished (verl exits 0 by
itself): ``<checkpoint_dir>/run-finished.json`` records the step and the overrides the run had,
then, for a Ray cluster, the step's model shards the head lacks copied from the other nodes
(``cluster-gather`` beside the plan), then the export (``verl_lab_export.py`` beside the launcher:
verl's model merger and its proof) and the GSM8K scores (``verl_lab_score.py``: the base model once, then the export), with the env's
Python; if one of them fails the launcher exits ``AFTER_RUN_FAILED``, which the unit does not
restart on (``RestartPreventExitStatus``). A later start of a finished run (same overrides, the same
latest checkpoint) trains no further step: it goes straight to the export, which a proven export
and kept scores make a no-op.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
PLAN_NAME = "plan.json"
# Box modules shipped beside the launcher (first name), or its siblings in the repo (second name).
GPU_READERS = ("verl_lab_gpu.py", "gpu.py")                       # the GPU reader
VLLM_SHARE = ("verl_lab_vllm_share.py", "vllm_share.py")          # vLLM's share arithmetic
CHECKPOINT_READERS = ("verl_lab_checkpoints.py", "checkpoints.py")  # the checkpoint disk check
PREFLIGHT = ("verl_lab_preflight.py", "preflight.py")            # the preflight's checks (a part)
AFTER_RUN = ("verl_lab_after_run.py", "after_run.py")            # what follows a run (a part)
BURNIN = ("verl_lab_burnin.py", "burnin.py")                     # the burn-in (a part, placed by deploy/burnin.py)
SHARE_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"


class PlanError(Exception):
    """plan.json cannot be read, or has no usable ``launch`` section."""


class Launch:
    """plan.json's ``launch`` section: what this launcher runs, where, and for which GPU."""

    def __init__(self, plan_file, plan):
        launch = plan.get("launch") if isinstance(plan, dict) else None
        if not isinstance(launch, dict):
            raise PlanError(f"{plan_file} has no launch section (written by an older deploy/train.py?)")
        try:
            paths = launch["paths"]
            self.host = str(launch["host"])
            self.plan_source = str(launch["plan_source"])
            self.gpu_name = str(launch["gpu"]["name"])
            self.gpu_count = int(launch["gpu"]["count"])
            self.gpu_memory_mib = int(launch["gpu"]["memory_mib"])
            # the models nvidia-smi should list (a mixed box is planned for its weakest)
            self.gpu_names = sorted(str(n) for n in launch["gpu"].get("names") or [self.gpu_name])
            self.predicted_peak_mib = int(launch["predicted_peak_mib"])
            # model states the plan keeps in host RAM (offload); 0 in plans written before it was recorded
            self.predicted_host_ram_mib = int(launch.get("predicted_host_ram_mib") or 0)
            # of it, the base weights patch 0013 saves while a LoRA actor's HF rollout generates merged
            self.predicted_lora_merge_host_mib = int(launch.get("predicted_lora_merge_host_mib") or 0)
            self.train_dir = paths["train_dir"]
            self.work_dir = paths["work_dir"]
            self.checkpoint_dir = paths["checkpoint_dir"]
            self.env_file = paths["env_file"]
            self.env_python = paths["env_python"]
            self.env_marker = paths["env_marker"]
            self.data_marker = paths["data_marker"]
            self.data_files = list(paths["data_files"])
            self.model_dir = paths["model_dir"]
            # verl.trainer.main_ppo overrides, each with the plan's reason
            self.overrides = [str(o["override"]) for o in launch["overrides"]]
            # vLLM's share and what it was sized from (None: the HF rollout, or a plan before it was recorded)
            self.vllm = launch.get("vllm") or None
            # the predicted save and what is kept (tasks/checkpoints.py); None in older plans
            self.checkpoints = launch.get("checkpoints")
            # the GSM8K evaluation after a finished run (tasks/evaluation.py); None in older plans
            self.evaluation = launch.get("evaluation")
            # a cluster run's gather on the head: the seconds it may take (tasks/train.py); None: its default
            self.gather_timeout_s = launch.get("gather_timeout_s")
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{plan_file}: its launch section is incomplete ({type(exc).__name__}: {exc})") from None
        self.plan_file = plan_file
        self.planned_overrides = plan.get("overrides")
        self.share = None        # the share the preflight sized for the GPUs as they are (check_vllm_share)
        self.extra = []          # overrides given by hand after `--`

    def run_overrides(self, extra=()):
        """The plan's overrides, with the share the preflight sized where it did, then ``extra``."""
        out = [f"{SHARE_KEY}={self.share}" if self.share is not None and o.startswith(SHARE_KEY + "=") else o
               for o in self.overrides]
        return out + list(extra)


def load_launch(plan_file):
    """The ``launch`` section of ``plan_file``; PlanError saying why not and what to do."""
    fix = "re-run deploy/train.py (it writes plan.json beside this launcher)"
    try:
        with open(plan_file) as fh:
            plan = json.load(fh)
    except OSError as exc:
        raise PlanError(f"the plan {plan_file} cannot be read ({exc.strerror or exc}): {fix}") from None
    except ValueError as exc:
        raise PlanError(f"the plan {plan_file} is not JSON ({exc}): {fix}") from None
    try:
        return Launch(plan_file, plan)
    except PlanError as exc:
        raise PlanError(f"{exc}: {fix}") from None


def box_file(names):
    """A box file beside this launcher (no package on the box): ``names`` are its shipped name and
    its name in the repo."""
    for name in names:
        path = os.path.join(HERE, name)
        if os.path.isfile(path):
            return path
    raise ImportError(f"no {' or '.join(names)} beside {os.path.abspath(__file__)}: re-run deploy/train.py")


def box_module(names, module_name):
    """A box module (``box_file``) loaded from beside this launcher."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, box_file(names))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module      # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def gpu_module():
    """verl_lab_box/gpu.py, the GPU reader."""
    return box_module(GPU_READERS, "verl_lab_gpu")


def vllm_share_module():
    """verl_lab_box/vllm_share.py, vLLM's share arithmetic (the plan's own)."""
    return box_module(VLLM_SHARE, "verl_lab_vllm_share")


def checkpoints_module():
    """verl_lab_box/checkpoints.py, the checkpoint disk check."""
    return box_module(CHECKPOINT_READERS, "verl_lab_checkpoints")


def part(names, module_name):
    """A part of this launcher (``box_module``), handed what it uses of the launcher as its ``launcher``:
    placed as ``train-launcher`` (no .py), the launcher is no module a part could import."""
    module = box_module(names, module_name)
    module.launcher = types.SimpleNamespace(
        path=os.path.abspath(__file__), SHARE_KEY=SHARE_KEY, box_file=box_file, box_module=box_module,
        run_child=run_child, ray_env=ray_env, gpu_module=gpu_module, vllm_share_module=vllm_share_module,
        checkpoints_module=checkpoints_module, preflight_module=preflight_module, after_run_module=after_run_module)
    return module


def preflight_module():
    """verl_lab_box/preflight.py, the preflight's checks."""
    return part(PREFLIGHT, "verl_lab_preflight")


def after_run_module():
    """verl_lab_box/after_run.py, whether the run finished, and the export and scores that follow it."""
    return part(AFTER_RUN, "verl_lab_after_run")


def ray_env(launch):
    """This process's environment with ``ray.env`` beside the plan under it (systemd sets these already:
    the unit's drop-in; a run by hand reads them here)."""
    env = dict(os.environ)
    with open(os.path.join(os.path.dirname(os.path.abspath(launch.plan_file)), "ray.env")) as fh:
        for line in fh:
            key, sep, value = line.strip().partition("=")
            if sep and not key.startswith("#"):
                env.setdefault(key, value)
    return env


def command(launch, extra=()):
    return [launch.env_python, "-m", "verl.trainer.main_ppo", *launch.run_overrides(extra)]


def load_env_file(launch):
    """The unit's EnvironmentFile, for a run by hand (systemd has set these already)."""
    try:
        with open(launch.env_file) as fh:
            for line in fh:
                line = line.strip()
                if line and not line.startswith("#") and "=" in line:
                    key, _, value = line.partition("=")
                    os.environ.setdefault(key, value)
    except OSError as exc:
        print(f"verl-lab: cannot read {launch.env_file} ({exc}); using the current environment", file=sys.stderr)


def print_overrides(launch, against_plan):
    print("\n".join(launch.overrides))
    if against_plan and launch.planned_overrides != launch.overrides:
        print(f"verl-lab: the launch section's overrides differ from the plan's in {launch.plan_file}",
              file=sys.stderr)
        return 1
    return 0


def plan_option(argv):
    """``--plan PATH`` / ``--plan=PATH`` taken out of argv; default: plan.json beside the launcher."""
    rest, plan_file = [], os.path.join(HERE, PLAN_NAME)
    args = iter(argv)
    for arg in args:
        if arg == "--plan":
            plan_file = next(args, None)
            if plan_file is None:
                raise PlanError("--plan needs a path to a plan.json")
        elif arg.startswith("--plan="):
            plan_file = arg[len("--plan="):]
        else:
            rest.append(arg)
    return rest, plan_file


# ---------------------------------------------------------------- the run and what follows it

def run_child(cmd, cwd, env=None):
    """``cmd`` as a child; SIGTERM, SIGINT and SIGHUP are passed on to it. Returns its exit status, or
    ends this process by the first such signal once the child is gone (a stopped run is no finished
    run, whatever the child's status)."""
    sys.stdout.flush()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env)
    got = []

    def forward(signum, _frame):
        got.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {sig: signal.signal(sig, forward) for sig in stops}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if got:
        print(f"verl-lab: stopped by signal {got[0]} (child exit {rc}): the run is not finished, nothing is "
              "exported", file=sys.stderr, flush=True)
        signal.signal(got[0], signal.SIG_DFL)
        os.kill(os.getpid(), got[0])
    return rc


def train(launch, extra, export=True):
    """verl's trainer as a child, then, when it finished by itself, the export and the scores."""
    launch.extra = list(extra)
    after = after_run_module()
    done = after.finished_step(launch, extra)
    last = None if done is not None else after.at_last_step(launch, extra)
    if done is not None:
        print(f"verl-lab: the run finished at step {done} already ({launch.checkpoint_dir}/{after.FINISHED}, the same "
              "overrides): no step is trained again", flush=True)
    elif last is not None:
        done = after.record_finished(launch, extra)
        print(f"verl-lab: the latest checkpoint (step {done}) is at or past the run's last step ({last}): verl is "
              "not started again (it would train one step past the plan); the run is finished", flush=True)
    else:
        checkpoints_module().prune_exports(launch.checkpoint_dir, say=lambda m: print(f"verl-lab: {m}", flush=True))
        rc = run_child(command(launch, extra), launch.work_dir)
        if rc != 0:
            print(f"verl-lab: verl exited {rc}: the run failed", file=sys.stderr, flush=True)
            return rc
        done = after.record_finished(launch, extra)
        print(f"verl-lab: the run finished (verl exited 0), latest checkpoint: step {done}", flush=True)
    return after.after_run(launch, final=True, gpu_free=True) if export else 0


def main(argv):
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
        bad = [e for e in extra if "=" not in e or e.startswith("-")]
        if bad:
            print(f"verl-lab: after -- only Hydra overrides KEY=VALUE are passed on, not {' '.join(bad)}",
                  file=sys.stderr)
            return 2
    if "--probe-env" in argv:
        preflight_module().probe_env()
        return 0
    try:
        argv, plan_file = plan_option(argv)
    except PlanError as exc:
        print(f"verl-lab: {exc}", file=sys.stderr)
        return 2
    try:
        launch = load_launch(plan_file)
    except PlanError as exc:
        if "--check" in argv or not ({"--print-overrides", "--no-preflight"} & set(argv)):
            return preflight_module().plan_failed(plan_file, str(exc))
        print(f"verl-lab: {exc}", file=sys.stderr)
        return 1
    if "--print-overrides" in argv:
        return print_overrides(launch, "--against-plan" in argv)
    load_env_file(launch)
    if "--check" in argv:
        return preflight_module().preflight(launch, extra)
    if "--burnin" in argv:
        return part(BURNIN, "verl_lab_burnin").burnin(launch, extra, keep="--keep" in argv,
                                                      preflight_first="--no-preflight" not in argv)
    if "--export" in argv:
        after = after_run_module()
        return after.after_run(launch, final=after.finished_step(launch) == after.latest_checkpoint(launch),
                               score="--no-score" not in argv)
    if "--no-preflight" not in argv and preflight_module().preflight(launch, extra) != 0:
        return 1
    return train(launch, extra, export="--no-export" not in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
