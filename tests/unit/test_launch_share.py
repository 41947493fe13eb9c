"""The launcher sizes vLLM's share again at start (verl_lab_box/preflight.py check_vllm_share,
with verl_lab_box/vllm_share.py, the plan's own arithmetic): what other processes hold on the GPU,
read from nvidia-smi as a box prints it (recorded outputs in tests/fixtures/nvidia-smi/: an RTX 3090
driving a desktop, the same with another user's compute job, a T4 with another process), replayed
by a stand-in nvidia-smi that answers each command with its recorded section.

Run here: the real launcher as a process (``--check``), the real GPU reader and share module beside
it as the training stage places them. Proves the plumbing (nvidia-smi read, the share passed as the
override, the preflight's words) and the arithmetic against vLLM's replayed accounting
(tests/unit/test_vllm_share.py); not on a GPU: no real nvidia-smi, no vLLM run."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tasks.facts.gpu import Gpu, GpuInventory
from tasks.train import training_wanted
from tests.unit.test_train_launcher import layout_for, run_launcher, settings_for

REPO = Path(__file__).resolve().parents[2]
CAPTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
SHARE = "actor_rollout_ref.rollout.gpu_memory_utilization"


def sections(path: Path) -> dict[str, str]:
    """A recording's commands ("$ nvidia-smi ...") -> what each printed."""
    out: dict[str, list[str]] = {}
    command = None
    for line in path.read_text().splitlines():
        if line.startswith("$ "):
            command = line[2:].strip()
            out[command] = []
        elif command is not None:
            out[command].append(line)
    return {c: "\n".join(lines).rstrip("\n") + "\n" for c, lines in out.items()}


REPLAY = '''#!{python}
import json, sys
recorded = json.load(open({path!r}))
asked = " ".join(["nvidia-smi", *sys.argv[1:]])
if asked not in recorded:
    sys.exit(f"stand-in nvidia-smi: no recording of {{asked!r}}")
sys.stdout.write(recorded[asked])
'''


def replay(bindir: Path, capture: str) -> None:
    """A stand-in nvidia-smi answering each command with ``capture``'s recorded section."""
    data = bindir / f"{capture}.json"
    data.write_text(json.dumps(sections(CAPTURES / capture)))
    smi = bindir / "nvidia-smi"
    smi.write_text(REPLAY.format(python=sys.executable, path=str(data)))
    smi.chmod(0o755)


def gpu_box(tmp_path, name, cc, mem, capture, **data):
    """A train dir for ``name`` as the training stage places it, with nvidia-smi replaying ``capture``."""
    s = settings_for(str(tmp_path / "lab"), launcher_python=sys.executable, **data)
    lay = layout_for(s, GpuInventory(gpus=(Gpu(0, name, cc, mem, mem - 300, "550.120"),)))
    for want in training_wanted(lay):
        if want.path.startswith(lay.train_dir):
            path = Path(want.path)
            path.mkdir(parents=True, exist_ok=True) if want.is_dir else path.write_bytes(want.content)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    replay(bindir, capture)
    return {"settings": s, "layout": lay, "launcher": Path(lay.launcher), "bin": bindir, "tmp": tmp_path}


RTX3090 = ("NVIDIA GeForce RTX 3090", "8.6", 24576)
T4 = ("Tesla T4", "7.5", 15360)


def check(box, *extra):
    out = run_launcher(box, "--check", *extra)
    return out, out.stdout.split("would run", 1)[1]


def test_the_recordings_read_as_a_box_prints_them():
    from verl_lab_box.gpu import parse_memory, parse_processes

    desk = sections(CAPTURES / "rtx3090-display.txt")
    (m,) = parse_memory(desk["nvidia-smi --query-gpu=index,memory.total,memory.used,memory.free --format=csv,noheader,nounits"])
    assert (m.total_mib, m.used_mib, m.free_mib, m.cuda_total_mib) == (24576, 812, 23438, 24250)
    procs = parse_processes(desk["nvidia-smi"])
    assert [(p.pid, p.kind, p.name, p.used_mib) for p in procs] == [
        (1634, "G", "/usr/lib/xorg/Xorg", 462), (1893, "G", "/usr/bin/gnome-shell", 153),
        (3120, "G", "...irefox/5134/usr/lib/firefox/firefox", 178)]
    assert sum(p.used_mib for p in procs) <= m.used_mib
    h200 = sections(CAPTURES / "h200.txt")                     # a real capture: no process listed
    assert parse_processes(h200["nvidia-smi"]) == []
    with pytest.raises(ValueError):
        parse_memory("0, NVIDIA H200, 9.0, 143771, 143156, 580.159.04\n")   # not the memory query's answer


def test_a_display_server_on_a_v1_gpu_raises_the_share_passed_to_verl(tmp_path):
    box = gpu_box(tmp_path, *RTX3090, "rtx3090-display.txt")
    out, would_run = check(box)
    line = next(line for line in out.stdout.splitlines() if "vllm share:" in line)
    assert line.startswith(f"  ok    vllm share: V1, V1 counts what other processes hold on the GPU: {SHARE} 0.42 -> 0.46 ")
    assert ("GPU 0: 812 MiB in use by /usr/lib/xorg/Xorg (pid 1634, 462 MiB), ...irefox/5134/usr/lib/firefox/firefox "
            "(pid 3120, 178 MiB), /usr/bin/gnome-shell (pid 1893, 153 MiB)") in line
    assert "CUDA counts GPU 0: 24250 MiB (the plan: 24576 MiB)" in line
    assert f"{SHARE}=0.46" in would_run and f"{SHARE}=0.42" not in would_run
    assert "ok    gpu memory: 23438 MiB free >= predicted peak 19414 MiB" in out.stdout


def test_a_v0_gpu_keeps_its_share_whatever_other_processes_hold(tmp_path):
    box = gpu_box(tmp_path, *T4, "t4-other-job.txt")
    out, would_run = check(box)
    line = next(line for line in out.stdout.splitlines() if "vllm share:" in line)
    assert line.startswith(f"  ok    vllm share: V0, V0 counts only vLLM's own memory (what other processes hold does "
                           f"not shrink its KV cache): {SHARE} 0.3 as planned (GPU 0: 1008 MiB in use by "
                           "/usr/bin/python3 (pid 77102, 1006 MiB); CUDA counts GPU 0: 15102 MiB")
    assert f"{SHARE}=0.3" in would_run


def test_where_the_gpu_cannot_hold_the_plan_the_preflight_names_what_holds_it_and_the_fixes(tmp_path):
    box = gpu_box(tmp_path, *RTX3090, "rtx3090-display-and-job.txt")
    out, _ = check(box)
    assert out.returncode == 1 and "gpu memory" in out.stderr
    line = next(line for line in out.stdout.splitlines() if "gpu memory:" in line)
    assert line == ("  FAIL  gpu memory: 17300 MiB free on a GPU, the plan's predicted peak is 19414 MiB; held before "
                    "training: GPU 0: 6950 MiB in use by /home/ana/venvs/sd/bin/python (pid 48213, 6138 MiB), "
                    "/usr/lib/xorg/Xorg (pid 1634, 462 MiB), ...irefox/5134/usr/lib/firefox/firefox (pid 3120, 178 MiB), "
                    "/usr/bin/gnome-shell (pid 1893, 153 MiB): stop them, or plan for less and re-run deploy/train.py: "
                    "a smaller workload.train_batch_size (fewer sequences at once), or workload.rollout = 'hf' in host "
                    "data (the HF rollout, no vLLM share: `python -m tasks.plan ... --rollout hf` shows its peak)")
    from tasks.doctor import diagnose
    assert "gpu-memory-short" in [f.rule for f in diagnose("box", {"preflight": out.stdout}).findings]


def test_a_share_above_what_vllm_takes_fails_with_the_numbers(tmp_path):
    box = gpu_box(tmp_path, *RTX3090, "rtx3090-display.txt")
    plan_file = Path(box["layout"].plan_file)
    plan = json.loads(plan_file.read_text())
    plan["launch"]["vllm"]["kv_wanted_mib"] = 16000.0       # a KV cache the GPU cannot give beside the rest
    plan_file.write_text(json.dumps(plan))
    out, would_run = check(box)
    line = next(line for line in out.stdout.splitlines() if "vllm share:" in line)
    # (vLLM's own 2817.3 + the process at vLLM's start 5677.2 + the desktop's 812 + 16000) / 24250 CUDA MiB = 1.044
    assert line.startswith("  FAIL  vllm share: V1: the plan's KV cache needs a share of 1.05, more than vLLM takes "
                           "(1.0): GPU 0: 812 MiB in use by /usr/lib/xorg/Xorg")
    assert "the plan's KV cache 16000 MiB" in line and "workload.rollout = 'hf'" in line
    assert f"{SHARE}=0.42" in would_run and out.returncode == 1
    from tasks.doctor import diagnose
    assert "vllm-share-at-launch" in [f.rule for f in diagnose("box", {"preflight": out.stdout}).findings]


def test_a_share_given_by_hand_an_hf_plan_or_an_older_plan_is_left_alone(tmp_path):
    box = gpu_box(tmp_path, *RTX3090, "rtx3090-display.txt")
    out, would_run = check(box, "--", f"{SHARE}=0.5")
    assert f"skip  vllm share: {SHARE} is given by hand after --: not sized again" in out.stdout
    assert would_run.count(f"{SHARE}=") == 2 and would_run.rindex(f"{SHARE}=0.5") > would_run.index(f"{SHARE}=0.42")
    hf = gpu_box(tmp_path / "hf", *RTX3090, "rtx3090-display.txt", workload={"rollout": "hf"})
    out, would_run = check(hf)
    assert "skip  vllm share: the plan's rollout is not vLLM" in out.stdout and SHARE not in would_run
    plan_file = Path(box["layout"].plan_file)
    plan = json.loads(plan_file.read_text())
    del plan["launch"]["vllm"]                                # a plan.json from before the share was recorded
    plan_file.write_text(json.dumps(plan))
    out, would_run = check(box)
    assert "skip  vllm share: the plan's share is passed as it is: plan.json has no vllm section" in out.stdout
    assert f"{SHARE}=0.42" in would_run


def test_the_sized_share_is_what_the_launcher_execs(tmp_path, monkeypatch):
    """In process: the preflight's share replaces the plan's in the command it execs (once, in
    place), the extra overrides after it; a failing nvidia-smi leaves the plan's share, saying so."""
    box = gpu_box(tmp_path, *RTX3090, "rtx3090-display.txt")
    loader = importlib.machinery.SourceFileLoader("launcher_under_test", str(box["launcher"]))   # placed without .py
    spec = importlib.util.spec_from_loader("launcher_under_test", loader)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("PATH", f"{box['bin']}:/usr/bin:/bin")
    for name in ("verl_lab_gpu", "verl_lab_vllm_share", "verl_lab_preflight"):   # the box's, placed beside it
        monkeypatch.delitem(sys.modules, name, raising=False)
    launch = mod.load_launch(box["layout"].plan_file)
    launch.extra = []
    preflight = mod.preflight_module()
    assert preflight.__file__ == str(box["launcher"].parent / "verl_lab_preflight.py")
    rep = preflight.Report()
    preflight.check_vllm_share(rep, launch)
    cmd = mod.command(launch, ["trainer.save_freq=-1"])
    assert [c for c in cmd if c.startswith(SHARE)] == [f"{SHARE}=0.46"] and cmd[-1] == "trainer.save_freq=-1"
    assert cmd.index(f"{SHARE}=0.46") == 3 + box["layout"].plan.override_lines.index(f"{SHARE}=0.42")
    (box["bin"] / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2; exit 9\n")
    launch = mod.load_launch(box["layout"].plan_file)
    launch.extra = []
    rep = preflight.Report()
    preflight.check_vllm_share(rep, launch)
    assert rep.results[-1][0] == "skip" and "the plan's share 0.42 is passed as it is" in rep.results[-1][2]
    assert f"{SHARE}=0.42" in mod.command(launch)
