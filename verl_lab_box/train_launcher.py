#!/usr/bin/env python3
"""verl-lab training launcher: verl PPO on this box, as the box's plan says.

Shipped unchanged by tasks/train.py (from verl_lab_box/train_launcher.py) to
``<train_dir>/train-launcher``, beside the box's ``plan.json``, ``verl_lab_gpu.py`` (the GPU
reader, verl_lab_box/gpu.py) and ``verl_lab_vllm_share.py`` (vLLM's share arithmetic,
verl_lab_box/vllm_share.py). Everything it knows comes from plan.json's ``launch`` section:
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

import hashlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PLAN_NAME = "plan.json"
# Box modules shipped beside the launcher (first name), or its siblings in the repo (second name).
GPU_READERS = ("verl_lab_gpu.py", "gpu.py")                       # the GPU reader
VLLM_SHARE = ("verl_lab_vllm_share.py", "vllm_share.py")          # vLLM's share arithmetic
CHECKPOINT_READERS = ("verl_lab_checkpoints.py", "checkpoints.py")  # the checkpoint disk check
SHARE_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"
EXPORTERS = ("verl_lab_export.py", "export.py")                    # the export and its proof
SCORERS = ("verl_lab_score.py", "gsm8k_score.py")                 # the GSM8K score
FINISHED = "run-finished.json"          # in the checkpoint folder: the run finished at this step
TRACKER = "latest_checkpointed_iteration.txt"   # verl's trainer writes it after each save
AFTER_RUN_FAILED = 70                    # the run finished, its export or score failed: not restarted


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


class Report:
    def __init__(self):
        self.results = []

    def add(self, status, name, detail):
        self.results.append((status, name, detail))
        print(f"  {status:<5} {name}: {detail}", flush=True)

    def ok(self, name, detail):
        self.add("ok", name, detail)

    def fail(self, name, detail):
        self.add("FAIL", name, detail)

    def skip(self, name, detail):
        self.add("skip", name, detail)

    @property
    def failed(self):
        return [name for status, name, _ in self.results if status == "FAIL"]


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


def gpus_at_launch(count):
    """What each of the first ``count`` GPUs holds now (nvidia-smi's memory query and its process
    table: compute and graphics processes), as vllm_share.GpuAtLaunch; ValueError where nvidia-smi
    does not answer the query."""
    gpu, share = gpu_module(), vllm_share_module()
    memory = gpu.parse_memory(subprocess.run(["sh", "-c", gpu.memory_command()], capture_output=True,
                                             text=True).stdout)
    if len(memory) < count:
        raise ValueError(f"nvidia-smi's memory query lists {len(memory)} GPU(s), the plan uses {count}")
    table = subprocess.run(["sh", "-c", "nvidia-smi"], capture_output=True, text=True).stdout
    processes = gpu.parse_processes(table)
    return [share.GpuAtLaunch(m.index, m.cuda_total_mib, m.used_mib,
                              tuple((p.pid, p.name, p.used_mib) for p in processes if p.gpu == m.index))
            for m in memory[:count]]


def holders(gpus):
    """Who holds memory on ``gpus``, largest first: "GPU 0: 1008 MiB in use by /usr/bin/python3 (pid 77102, 1006 MiB)"."""
    words = []
    for g in gpus:
        procs = sorted(g.processes, key=lambda p: -(p[2] or 0))
        listed = ", ".join(f"{name} (pid {pid}, {'?' if mib is None else mib} MiB)" for pid, name, mib in procs)
        words.append(f"GPU {g.index}: {g.in_use_mib} MiB in use" + (f" by {listed}" if listed else ""))
    return "; ".join(words)


LESS_MEMORY = ("stop them, or plan for less and re-run deploy/train.py: a smaller workload.train_batch_size (fewer "
               "sequences at once), or workload.rollout = 'hf' in host data (the HF rollout, no vLLM share: "
               "`python -m tasks.plan ... --rollout hf` shows its peak)")


def check_gpu(rep, launch):
    """nvidia-smi: the GPUs match the plan, with enough free memory."""
    gpu = gpu_module()
    name, count, memory = launch.gpu_name, launch.gpu_count, launch.gpu_memory_mib
    out = subprocess.run(["sh", "-c", gpu.fact_command()], capture_output=True, text=True)
    inv = gpu.parse_fact_output(out.stdout)
    if not inv.ok:
        rep.fail("gpu", f"nvidia-smi: {inv.problem}")
        rep.skip("gpu memory", "no GPU list")
        return
    names = sorted({g.name for g in inv.gpus})
    problems = []
    cluster = any(o.startswith("trainer.nnodes=") and o != "trainer.nnodes=1" for o in launch.overrides)
    if names != launch.gpu_names and not cluster:   # a cluster's plan is for its weakest GPU: count and memory count here
        problems.append(f"the plan is for {', '.join(launch.gpu_names)}, nvidia-smi lists {', '.join(names)}")
    if len(inv.gpus) < count:
        problems.append(f"the plan uses {count} GPUs, nvidia-smi lists {len(inv.gpus)}")
    small = [g for g in inv.gpus[:count] if g.memory_total_mib < memory]
    if small:
        problems.append(f"GPU {small[0].index} has {small[0].memory_total_mib} MiB, the plan assumed {memory} MiB")
    if problems:
        rep.fail("gpu", "; ".join(problems) + f" (re-run deploy/train.py to plan for this GPU; plan from "
                                               f"{launch.plan_source})")
    else:
        rep.ok("gpu", f"{len(inv.gpus)} x {name}, {memory} MiB, driver {inv.driver_version}")
    free = [g.memory_free_mib for g in inv.gpus[:count]]
    peak = launch.predicted_peak_mib
    if any(f is None for f in free):
        rep.skip("gpu memory", "nvidia-smi reports no free memory")
    elif min(free) < peak:
        try:
            held = holders(gpus_at_launch(count))
        except (OSError, ValueError) as exc:
            held = f"nvidia-smi does not say which process ({exc})"
        rep.fail("gpu memory", f"{min(free)} MiB free on a GPU, the plan's predicted peak is {peak} MiB; held before "
                               f"training: {held}: {LESS_MEMORY}")
    else:
        rep.ok("gpu memory", f"{min(free)} MiB free >= predicted peak {peak} MiB")


def check_vllm_share(rep, launch):
    """vLLM's share sized again for the GPUs as they are now (verl_lab_box/vllm_share.py): under V1
    it counts what other processes hold, so it grows by that; under V0 it does not; both multiply
    it by the total CUDA counts (nvidia-smi's used + free). The share that keeps the plan's KV cache
    becomes the override; above 1.0 (vLLM refuses it) the check fails."""
    if not launch.vllm:
        rep.skip("vllm share", "the plan's share is passed as it is: plan.json has no vllm section (written by an "
                               "older deploy/train.py: re-run it)" if "actor_rollout_ref.rollout.name=vllm" in
                 launch.overrides else "the plan's rollout is not vLLM")
        return
    if any(e.lstrip("+").startswith(SHARE_KEY + "=") for e in launch.extra):
        rep.skip("vllm share", f"{SHARE_KEY} is given by hand after --: not sized again")
        return
    try:
        gpus = gpus_at_launch(launch.gpu_count)
    except (OSError, ValueError) as exc:
        rep.skip("vllm share", f"nvidia-smi's memory query failed ({exc}): the plan's share "
                               f"{launch.vllm['share']} is passed as it is")
        return
    decision = vllm_share_module().launch_share(launch.vllm, gpus)
    engine = decision.engine.upper()
    how = ("V1 counts what other processes hold on the GPU" if decision.engine == "v1" else
           "V0 counts only vLLM's own memory (what other processes hold does not shrink its KV cache)")
    cuda = ", ".join(f"GPU {g.index}: {g.cuda_total_mib} MiB" for g in gpus)
    numbers = (f"{holders(gpus)}; CUDA counts {cuda} (the plan: {launch.vllm['gpu_memory_mib']} MiB); the plan's KV "
               f"cache {launch.vllm['kv_wanted_mib']:.0f} MiB")
    if not decision.fits:
        rep.fail("vllm share", f"{engine}: the plan's KV cache needs a share of {decision.share:.2f}, more than vLLM "
                               f"takes (1.0): {numbers}: {LESS_MEMORY}")
        return
    launch.share = decision.share
    change = (f"{decision.planned} -> {decision.share}" if decision.changed else f"{decision.share} as planned")
    rep.ok("vllm share", f"{engine}, {how}: {SHARE_KEY} {change} ({numbers})")


def check_driver(rep, launch):
    """The kernel driver: what CUDA opens, whatever nvidia-smi prints."""
    missing = [p for p in ["/proc/driver/nvidia/version", "/dev/nvidiactl"]
               + [f"/dev/nvidia{i}" for i in range(launch.gpu_count)] if not os.path.exists(p)]
    if missing:
        rep.fail("cuda device", "no usable CUDA device: " + ", ".join(missing) + " missing (no NVIDIA kernel driver "
                                "is loaded here, whatever nvidia-smi answers)")
    else:
        with open("/proc/driver/nvidia/version") as fh:
            rep.ok("cuda device", fh.readline().strip())


def probe_env():
    """Runs under the env's Python: what torch, verl and NVML say, as JSON."""
    found = {"python": sys.version.split()[0]}
    try:
        import torch

        found["torch"] = torch.__version__
        found["torch_cuda"] = torch.version.cuda
        found["cuda_available"] = bool(torch.cuda.is_available())
        found["device_count"] = torch.cuda.device_count() if found["cuda_available"] else 0
        if found["cuda_available"]:
            found["devices"] = [torch.cuda.get_device_name(i) for i in range(found["device_count"])]
            found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:
        found["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import verl

        found["verl"] = getattr(verl, "__version__", "unknown")
    except Exception as exc:
        found["verl_error"] = f"{type(exc).__name__}: {exc}"
    nvml = gpu_module().read_nvml()
    found["nvml"] = {"ok": nvml.ok, "problem": nvml.problem, "gpus": [g.name for g in nvml.gpus]}
    print(json.dumps(found))


def check_env(rep, launch):
    env_marker, env_python = launch.env_marker, launch.env_python
    if os.path.isfile(env_marker):
        rep.ok("env marker", env_marker)
    else:
        rep.fail("env marker", f"{env_marker} missing: the Python env stage has not finished on this box")
    if not os.access(env_python, os.X_OK):
        rep.fail("env python", f"{env_python} does not exist: the Python env stage has not run on this box")
        rep.skip("torch", "no env python to ask")
        return
    try:
        out = subprocess.run([env_python, os.path.abspath(__file__), "--probe-env"], capture_output=True,
                             text=True, timeout=600)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:
        rep.fail("env python", f"{env_python} could not be asked about torch/verl: {exc}")
        return
    if "torch_error" in found:
        rep.fail("torch", f"the env cannot import torch: {found['torch_error']}")
    elif not found["cuda_available"]:
        rep.fail("torch", f"no usable CUDA device is visible to torch (torch {found['torch']}, built for CUDA "
                          f"{found['torch_cuda'] or 'none'}): training cannot run on this box")
    elif found["device_count"] < launch.gpu_count:
        rep.fail("torch", f"torch sees {found['device_count']} CUDA devices, the plan uses {launch.gpu_count}")
    else:
        rep.ok("torch", f"torch {found['torch']} (CUDA {found['torch_cuda']}) sees {found['device_count']} x "
                        f"{found['devices'][0]}, compute capability {found['capability']}")
    if "verl_error" in found:
        rep.fail("verl", f"the env cannot import verl: {found['verl_error']}")
    else:
        rep.ok("verl", f"verl {found['verl']}")
    nvml = found["nvml"]
    if nvml["ok"]:
        rep.ok("nvml", ", ".join(nvml["gpus"]))
    elif "not installed" in (nvml["problem"] or ""):
        rep.skip("nvml", nvml["problem"])
    else:
        rep.fail("nvml", nvml["problem"])


def check_data(rep, launch):
    data_marker, data_files, model_dir = launch.data_marker, launch.data_files, launch.model_dir
    if os.path.isfile(data_marker):
        rep.ok("data marker", data_marker)
    else:
        rep.fail("data marker", f"{data_marker} missing: the model and data stage has not finished on this box")
    missing = [p for p in data_files if not os.path.isfile(p)]
    if missing:
        rep.fail("data", "missing " + ", ".join(missing))
    else:
        rep.ok("data", ", ".join(data_files))
    weights = [n for n in (os.listdir(model_dir) if os.path.isdir(model_dir) else []) if n.endswith(".safetensors")]
    if not os.path.isfile(os.path.join(model_dir, "config.json")) or not weights:
        rep.fail("model", f"{model_dir} has no config.json and *.safetensors: the model stage has not finished")
    else:
        rep.ok("model", f"{model_dir} ({', '.join(sorted(weights))})")


def check_dirs(rep, launch):
    bad = [d for d in (launch.work_dir, launch.checkpoint_dir) if not os.access(d, os.W_OK)]
    if bad:
        rep.fail("train dirs", f"not writable by this user: {', '.join(bad)}")
    else:
        rep.ok("train dirs", f"{launch.work_dir}, {launch.checkpoint_dir} writable")


def check_disk(rep, launch):
    """The disk under the checkpoint folder holds the kept saves, the one being written and the
    export; saves already there count where verl removes or overwrites them."""
    cp = launch.checkpoints
    if not cp:
        rep.skip("checkpoint disk", "the plan predicts no save size (re-run deploy/train.py)")
        return
    ck = checkpoints_module()
    need = ck.disk_need(cp["save_bytes"], cp["max_saves"], cp["export_bytes"], cp["every"], ck.scan(cp["dir"]),
                        cp.get("saves_in_run"), cp.get("last_step"))
    if need["fits"]:
        rep.ok("checkpoint disk", f"{ck.gib(need['free_bytes'])} free under {cp['dir']} >= {ck.gib(need['need_bytes'])} "
                                  f"for {need['new_saves']} saves of {ck.gib(need['save_bytes'])} and the export")
    else:
        rep.fail("checkpoint disk", ck.need_words(need, cp["dir"], cp["keep"]))


def check_host_ram(rep, launch, meminfo="/proc/meminfo"):
    """The box's RAM holds what the plan offloads to it (params, gradients, AdamW states, the ref)."""
    need = launch.predicted_host_ram_mib
    try:
        with open(meminfo) as fh:
            total = next(int(line.split()[1]) // 1024 for line in fh if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):
        rep.skip("host ram", f"cannot read MemTotal from {meminfo}")
        return
    if total < need:
        rep.fail("host ram", f"the plan keeps {need} MiB of model states in host RAM (CPU offload), the box has "
                             f"{total} MiB in all: train a smaller model (workload.model) or add RAM")
    else:
        rep.ok("host ram", f"{total} MiB >= {need} MiB of offloaded model states, before the processes' own")


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


def check_cluster(rep, launch):
    """A plan for a Ray cluster (trainer.nnodes > 1): every node joined, with the head's env, model
    and data (``cluster-check`` beside the plan, in the env's Python, with ``ray.env`` beside it)."""
    nodes = next((o.split("=", 1)[1] for o in launch.overrides if o.startswith("trainer.nnodes=")), "1")
    if nodes == "1":
        return
    here = os.path.dirname(os.path.abspath(launch.plan_file))
    res = subprocess.run([launch.env_python, os.path.join(here, "cluster-check"), "--plan", launch.plan_file],
                         capture_output=True, text=True, timeout=600, env=ray_env(launch))
    lines = [line.strip() for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    if res.returncode == 0:
        rep.ok("cluster", (res.stdout.strip().splitlines() or [f"{nodes} nodes"])[-1])
    else:
        named = [line for line in lines if line.startswith("node ") or "joined" in line]
        rep.fail("cluster", "; ".join(named or lines[-3:]) or f"cluster-check exited {res.returncode}")


def command(launch, extra=()):
    return [launch.env_python, "-m", "verl.trainer.main_ppo", *launch.run_overrides(extra)]


def plan_failed(plan_file, problem):
    """The preflight without a readable plan: one failed check, and why."""
    print(f"verl-lab preflight: no plan to check against ({plan_file})", flush=True)
    Report().fail("plan", problem)
    print(f"verl-lab preflight FAILED: 1 of 1 checks failed (plan): {problem}", file=sys.stderr, flush=True)
    return 1


def preflight(launch, extra=()):
    host = launch.host
    print(f"verl-lab preflight on {host}: {launch.gpu_count} x {launch.gpu_name} planned (plan from "
          f"{launch.plan_source})", flush=True)
    rep = Report()
    launch.extra = list(extra)
    for check in (check_gpu, check_vllm_share, check_driver, check_host_ram, check_env, check_data, check_dirs,
                  check_disk, check_cluster):
        try:
            check(rep, launch)
        except Exception as exc:  # a check that breaks is a failed check, not a traceback
            rep.fail(check.__name__[len("check_"):].replace("_", " "), f"{type(exc).__name__}: {exc}")
    print(f"would run (in {launch.work_dir}):\n  {launch.env_python} -m verl.trainer.main_ppo \\\n    "
          + " \\\n    ".join(shlex.quote(o) for o in launch.run_overrides(extra)), flush=True)
    if rep.failed:
        print(f"verl-lab preflight FAILED on {host}: {len(rep.failed)} of {len(rep.results)} checks failed "
              f"({', '.join(rep.failed)})", file=sys.stderr, flush=True)
        return 1
    print(f"verl-lab preflight passed on {host}", flush=True)
    return 0


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


def latest_checkpoint(launch):
    try:
        with open(os.path.join(launch.checkpoint_dir, TRACKER)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def run_digest(launch, extra):
    return hashlib.sha256(json.dumps([*launch.overrides, *extra]).encode()).hexdigest()


def finished_step(launch, extra=None):
    """The step the run finished at (``run-finished.json``), when that is still the latest checkpoint
    and, with ``extra`` given, the run had these overrides; else None."""
    try:
        with open(os.path.join(launch.checkpoint_dir, FINISHED)) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("step") is None or record.get("step") != latest_checkpoint(launch):
        return None
    if extra is not None and record.get("overrides_sha256") != run_digest(launch, extra):
        return None
    return record["step"]


def record_finished(launch, extra):
    """``run-finished.json``: the run finished at the latest checkpoint, with these overrides."""
    done = latest_checkpoint(launch)
    part = os.path.join(launch.checkpoint_dir, FINISHED + ".part")
    with open(part, "w") as fh:
        json.dump({"step": done, "overrides_sha256": run_digest(launch, extra)}, fh)
    os.replace(part, os.path.join(launch.checkpoint_dir, FINISHED))
    return done


def marker_value(path, key):
    """An integer ``key=value`` of a stage's marker (the data stage's ``train_rows``), or None."""
    try:
        with open(path) as fh:
            found = dict(line.strip().partition("=")[::2] for line in fh if "=" in line)
    except OSError:
        return None
    value = found.get(key, "")
    return int(value) if value.isdigit() else None


def at_last_step(launch, extra):
    """The planned last step when the latest checkpoint is at or past it, else None: verl 0.5.0
    adds 1 to the step it loads before it checks for the last one (ray_trainer.py ``fit``), so
    started again from its last save it would train a step past the plan."""
    last = checkpoints_module().planned_last_step(launch.run_overrides(extra),
                                                  marker_value(launch.data_marker, "train_rows"))
    latest = latest_checkpoint(launch)
    return last if last is not None and latest is not None and latest >= last else None


def train(launch, extra, export=True):
    """verl's trainer as a child, then, when it finished by itself, the export and the scores."""
    launch.extra = list(extra)
    done = finished_step(launch, extra)
    last = None if done is not None else at_last_step(launch, extra)
    if done is not None:
        print(f"verl-lab: the run finished at step {done} already ({launch.checkpoint_dir}/{FINISHED}, the same "
              "overrides): no step is trained again", flush=True)
    elif last is not None:
        done = record_finished(launch, extra)
        print(f"verl-lab: the latest checkpoint (step {done}) is at or past the run's last step ({last}): verl is "
              "not started again (it would train one step past the plan); the run is finished", flush=True)
    else:
        checkpoints_module().prune_exports(launch.checkpoint_dir, say=lambda m: print(f"verl-lab: {m}", flush=True))
        rc = run_child(command(launch, extra), launch.work_dir)
        if rc != 0:
            print(f"verl-lab: verl exited {rc}: the run failed", file=sys.stderr, flush=True)
            return rc
        done = record_finished(launch, extra)
        print(f"verl-lab: the run finished (verl exited 0), latest checkpoint: step {done}", flush=True)
    return after_run(launch, final=True, gpu_free=True) if export else 0


def gather_on_head(launch, step):
    """A Ray cluster's run: each node saved its own ranks' shards on its own disk; ``cluster-gather`` (beside
    the plan, as the cluster stage places it) copies the step's model shards and rank 0's files the head lacks,
    over Ray. None when the export may go on (gathered, or no save at all); else the exit status: 2 on a
    worker (a cluster is exported on its head), AFTER_RUN_FAILED when the step cannot be made whole here."""
    try:
        env = ray_env(launch)
    except OSError as exc:
        print(f"verl-lab: a cluster run, but {exc.filename or 'ray.env'} cannot be read ({exc.strerror or exc}): "
              "re-run deploy/cluster.py; not exported", file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    me, head = env.get("VERL_LAB_NODE_IP", ""), env.get("RAY_ADDRESS", "").rpartition(":")[0]
    if me and head and me != head:
        print(f"verl-lab: this box ({me}) is a worker of the Ray cluster whose head is {head}: a cluster run is "
              "exported on its head (train-launcher --export there, or deploy/export.py)", file=sys.stderr, flush=True)
        return 2
    saves = [o.split("=", 1)[1] for o in launch.run_overrides(launch.extra) if o.startswith("trainer.save_freq=")]
    if step is None:
        if saves and saves[-1].isdigit() and int(saves[-1]) > 0:
            # the run saved, yet the head has no tracker: verl's TaskRunner wrote it on another node's disk
            print(f"verl-lab: the cluster run saved (trainer.save_freq={saves[-1]}) but {launch.checkpoint_dir} has "
                  f"no {TRACKER}: verl's TaskRunner ran on another node (is patch 0010 in the env? deploy/env.py "
                  "applies it), so the export and a restart cannot find the checkpoint: not exported",
                  file=sys.stderr, flush=True)
            return AFTER_RUN_FAILED
        return None
    gather = [launch.env_python, os.path.join(os.path.dirname(os.path.abspath(launch.plan_file)), "cluster-gather"),
              "--plan", launch.plan_file, "--step", str(step)]
    try:
        rc = run_child(gather, launch.work_dir, env=env)
    except OSError as exc:
        rc = f"not run ({exc})"
    if rc != 0:
        print(f"verl-lab: the cluster's step {step} cannot be gathered on this head (cluster-gather exit {rc}; its "
              "reason is above): not exported", file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    return None


def export_ram_mib(launch, gpu_free):
    """The host RAM the export needs (plan.json ``launch.checkpoints.export_host_ram``: its fp32
    model on the GPU once training released it, else in host RAM), or None in older plans. The
    export checks it against MemAvailable under the step's lock, before it merges."""
    ram = (launch.checkpoints or {}).get("export_host_ram")
    return (ram["gpu_free_mib"] if gpu_free else ram["gpu_busy_mib"]) if ram else None


def after_run(launch, final, score=True, gpu_free=False):
    """The latest actor checkpoint as a proven Hugging Face folder (verl_lab_export.py), then the base
    model's GSM8K score (kept once made) and the export's (verl_lab_score.py); a Ray cluster's step gathered on
    the head first (``gather_on_head``). 0, AFTER_RUN_FAILED, or 2 on a cluster's worker."""
    step = latest_checkpoint(launch)
    ckpt = launch.checkpoint_dir
    ev = launch.evaluation
    if any(o.startswith("trainer.nnodes=") and o != "trainer.nnodes=1" for o in launch.overrides):
        rc = gather_on_head(launch, step)
        if rc is not None:
            return rc
    if step is None:
        print(f"verl-lab: no checkpoint in {ckpt} to export (trainer.save_freq=-1?)", flush=True)
        return 0
    try:
        exporter, scorer = box_file(EXPORTERS), box_file(SCORERS)
    except ImportError as exc:
        print(f"verl-lab: {exc}", file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    cmd = [launch.env_python, exporter, "--checkpoint-dir", ckpt, "--step", str(step)]
    if export_ram_mib(launch, gpu_free):
        cmd += ["--host-ram-mib", str(export_ram_mib(launch, gpu_free))]
    if run_child(cmd + (["--final"] if final else []), launch.work_dir) != 0:
        print(f"verl-lab: the export of step {step} failed (the merge's or the proof's error is above)",
              file=sys.stderr, flush=True)
        return AFTER_RUN_FAILED
    if not score:
        return 0
    if not ev or ev.get("problem"):
        why = ev["problem"] if ev else "it has no evaluation section (written by an older deploy/train.py?)"
        print(f"verl-lab: not scored: {launch.plan_file}: {why}", flush=True)
        return 0
    common = ["--data", ev["test_file"], "--engine", ev["engine"], "--dtype", ev["dtype"], "--batch", str(ev["batch"]),
              "--prompt-len", str(ev["prompt_len"]), "--max-new-tokens", str(ev["max_new_tokens"]),
              "--tensor-parallel", str(ev.get("tensor_parallel_size") or 1)]
    if ev.get("vllm_gpu_memory_utilization"):
        common += ["--vllm-share", str(ev["vllm_gpu_memory_utilization"])]
    step_dir = os.path.join(ckpt, f"global_step_{step}")
    scores = {"base": ([launch.model_dir, os.path.join(ckpt, "gsm8k-base.json"), "base", "0"], False),
              "trained": ([os.path.join(step_dir, "hf"), os.path.join(step_dir, "hf.gsm8k.json"), f"global_step_{step}",
                           str(step)], final)}
    found = {}
    for what, ((model, out, label, at), is_final) in scores.items():
        cmd = [launch.env_python, scorer, "--model", model, "--out", out, "--label", label, "--step", at,
               *common, *(["--final"] if is_final else [])]
        if run_child(cmd, launch.work_dir) != 0:
            print(f"verl-lab: the GSM8K score of the {what} model failed (its error is above)", file=sys.stderr,
                  flush=True)
            return AFTER_RUN_FAILED
        with open(out) as fh:
            found[what] = json.load(fh)
    base, trained = found["base"], found["trained"]
    print(f"verl-lab: GSM8K {base['accuracy']:.4f} (base) -> {trained['accuracy']:.4f} (step {step}"
          f"{'' if final else ', not final'}) on {trained['rows']} test prompts, {ev['engine']} greedy", flush=True)
    return 0


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
        probe_env()
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
            return plan_failed(plan_file, str(exc))
        print(f"verl-lab: {exc}", file=sys.stderr)
        return 1
    if "--print-overrides" in argv:
        return print_overrides(launch, "--against-plan" in argv)
    load_env_file(launch)
    if "--check" in argv:
        return preflight(launch, extra)
    if "--export" in argv:
        return after_run(launch, final=finished_step(launch) == latest_checkpoint(launch),
                         score="--no-score" not in argv)
    if "--no-preflight" not in argv and preflight(launch, extra) != 0:
        return 1
    return train(launch, extra, export="--no-export" not in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
