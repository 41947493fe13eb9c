"""The training launcher's preflight (its part, verl_lab_box/preflight.py): may this box run the plan now?

Placed by tasks/train.py as ``<train_dir>/verl_lab_preflight.py`` beside the launcher
(``train-launcher``, verl_lab_box/train_launcher.py), which loads it (``preflight_module``) and hands
it what it uses of the launcher as ``launcher``: its loaders of the GPU reader, vLLM's share arithmetic
and the checkpoint disk check, its own path (``--probe-env``), ``ray.env``. Standard library only.

Each check reports ok, FAIL or skip with the reason and the fix: the GPUs against the plan and their
free memory (who holds the rest), vLLM's share sized again for the GPUs as they are
(``check_vllm_share``: the share that keeps the plan's KV cache becomes the override), the kernel
driver, host RAM for offloaded states, the env (torch, verl, NVML asked in the env's Python), the
data and model, the train dirs, the checkpoint disk, and a Ray cluster's nodes (``cluster-check``).
"""

import json
import os
import shlex
import subprocess
import sys

launcher = None     # what this part uses of the launcher that loaded it (train_launcher.part)


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


def gpus_at_launch(count):
    """What each of the first ``count`` GPUs holds now (nvidia-smi's memory query and its process
    table: compute and graphics processes), as vllm_share.GpuAtLaunch; ValueError where nvidia-smi
    does not answer the query."""
    gpu, share = launcher.gpu_module(), launcher.vllm_share_module()
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
    gpu = launcher.gpu_module()
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
    if any(e.lstrip("+").startswith(launcher.SHARE_KEY + "=") for e in launch.extra):
        rep.skip("vllm share", f"{launcher.SHARE_KEY} is given by hand after --: not sized again")
        return
    try:
        gpus = gpus_at_launch(launch.gpu_count)
    except (OSError, ValueError) as exc:
        rep.skip("vllm share", f"nvidia-smi's memory query failed ({exc}): the plan's share "
                               f"{launch.vllm['share']} is passed as it is")
        return
    decision = launcher.vllm_share_module().launch_share(launch.vllm, gpus)
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
    rep.ok("vllm share", f"{engine}, {how}: {launcher.SHARE_KEY} {change} ({numbers})")


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
    nvml = launcher.gpu_module().read_nvml()
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
        out = subprocess.run([env_python, launcher.path, "--probe-env"], capture_output=True,
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
    ck = launcher.checkpoints_module()
    need = ck.disk_need(cp["save_bytes"], cp["max_saves"], cp["export_bytes"], cp["every"], ck.scan(cp["dir"]),
                        cp.get("saves_in_run"), cp.get("last_step"))
    if need["fits"]:
        rep.ok("checkpoint disk", f"{ck.gib(need['free_bytes'])} free under {cp['dir']} >= {ck.gib(need['need_bytes'])} "
                                  f"for {need['new_saves']} saves of {ck.gib(need['save_bytes'])} and the export")
    else:
        rep.fail("checkpoint disk", ck.need_words(need, cp["dir"], cp["keep"]))


def check_host_ram(rep, launch, meminfo="/proc/meminfo"):
    """The box's RAM holds what the plan keeps there: what it offloads (params, gradients, AdamW states, the ref)
    and, with LoRA and the HF rollout, the base weights patch 0013 saves while it generates merged."""
    need = launch.predicted_host_ram_mib
    merge = getattr(launch, "predicted_lora_merge_host_mib", 0)
    what = (f"{need} MiB in host RAM ({need - merge} MiB of offloaded model states, {merge} MiB of base weights "
            "saved while the LoRA adapter is merged for generation)" if merge
            else f"{need} MiB of model states in host RAM (CPU offload)")
    try:
        with open(meminfo) as fh:
            total = next(int(line.split()[1]) // 1024 for line in fh if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):
        rep.skip("host ram", f"cannot read MemTotal from {meminfo}")
        return
    if total < need:
        rep.fail("host ram", f"the plan keeps {what}, the box has {total} MiB in all: train a smaller model "
                             "(workload.model) or add RAM")
    else:
        rep.ok("host ram", f"{total} MiB >= the plan's {what}, before the processes' own")


LORA_RANK = "actor_rollout_ref.model.lora_rank="


def check_resume(rep, launch):
    """The save verl resumes from (``trainer.resume_mode=auto``: the tracker's step) is one this plan can load. A
    LoRA run's actor save (``actor/lora_adapter`` beside its shards) holds the PEFT-wrapped model's weights, under
    other names than the full model's, and verl 0.5.0 loads a save with the model's strict ``load_state_dict``
    (``verl/utils/checkpoint/fsdp_checkpoint_manager.py`` ``load_checkpoint``): after ``workload.finetune`` changed,
    the earlier run's saves (and its exports, a LoRA adapter among them) are kept, not deleted (a deploy never
    deletes a trained model: tasks/undo.py), and the new run cannot start on them."""
    cp = launch.checkpoints
    if not cp:
        return
    ck = launcher.checkpoints_module()
    step = ck.read_tracker(ck.read_small(os.path.join(cp["dir"], ck.TRACKER)) or "")
    actor = os.path.join(cp["dir"], f"global_step_{step}", "actor") if step is not None else None
    if actor is None or not os.path.isdir(actor):
        rep.ok("resume", f"no save in {cp['dir']} to resume: the run starts at step 1")
        return
    saved = os.path.isdir(os.path.join(actor, "lora_adapter"))
    rank = next((o[len(LORA_RANK):] for o in launch.overrides if o.startswith(LORA_RANK)), "0")
    wanted = rank not in ("", "0")
    kind = {True: "LoRA", False: "full fine-tuning"}
    if saved == wanted:
        rep.ok("resume", f"from step {step} ({kind[saved]}, as the plan trains)")
        return
    rep.fail("resume", f"the save verl would resume, {actor}, is a {kind[saved]} run's and this plan trains with "
                       f"{kind[wanted]} (workload.finetune): verl cannot load it. That run's saves and exports are "
                       f"kept: move them aside as root (mv {cp['dir']} {cp['dir']}.{'lora' if saved else 'full'}-"
                       f"step{step}; deploy/train.py makes a new folder), or set workload.finetune back")


def check_cluster(rep, launch):
    """A plan for a Ray cluster (trainer.nnodes > 1): every node joined, with the head's env, model
    and data (``cluster-check`` beside the plan, in the env's Python, with ``ray.env`` beside it)."""
    nodes = next((o.split("=", 1)[1] for o in launch.overrides if o.startswith("trainer.nnodes=")), "1")
    if nodes == "1":
        return
    here = os.path.dirname(os.path.abspath(launch.plan_file))
    res = subprocess.run([launch.env_python, os.path.join(here, "cluster-check"), "--plan", launch.plan_file],
                         capture_output=True, text=True, timeout=600, env=launcher.ray_env(launch))
    lines = [line.strip() for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    if res.returncode == 0:
        rep.ok("cluster", (res.stdout.strip().splitlines() or [f"{nodes} nodes"])[-1])
    else:
        named = [line for line in lines if line.startswith("node ") or "joined" in line]
        rep.fail("cluster", "; ".join(named or lines[-3:]) or f"cluster-check exited {res.returncode}")


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
                  check_disk, check_resume, check_cluster):
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
