"""README's first command, run as a newcomer runs it: the command block is read from README.md
(so the two cannot drift) and run as written, in a copy of the repo with no venv, by bash, from
a PATH without this test run's venv. It makes a fresh venv, installs verl-lab with its test
extras, boots one lab-in-a-box host, provisions it and prints the plan the box got; `bin/lab
down` runs afterwards whatever happened.

The caches the other e2e tests fill are shared (the Debian rootfs, the stand-ins' wheels and
sdists, pip's own cache), so a run takes a few minutes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.lab import requirements_missing

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def readme_paragraphs() -> list[str]:
    """The first ```bash block of README.md, split at blank lines."""
    m = re.search(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)
    assert m, "README.md has no ```bash block"
    return [p.strip("\n") for p in m.group(1).split("\n\n") if p.strip()]


def commands(paragraph: str) -> list[str]:
    return [line for line in paragraph.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_readme_first_screen_gives_the_demo_beside_ones_own_lab_and_the_tests():
    demo, own, *more, tests = readme_paragraphs()       # more: the lab's TensorBoard (docs/tracking.md)
    assert all("deploy/" in "\n".join(commands(p)) for p in more)
    demo_text = "\n".join(commands(demo))
    assert "python3 -m venv" in demo_text and "pip install -e '.[test]'" in demo_text
    for step in ("bin/lab up", "pyinfra -y .lab/inventory.py deploy/full.py", "bin/lab plans"):
        assert step in demo_text, step
    assert "inventory/lab.py deploy/full.py" in "\n".join(commands(own))
    assert commands(tests) == ["bash .ci/run"]


def repo_copy(dest: Path) -> Path:
    """The files a clone has (tracked, and new ones git does not ignore), as they are now."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, out.split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def newcomer_env() -> dict[str, str]:
    """This process's environment without its venv: no VIRTUAL_ENV, PYTHONPATH or venv bin dir."""
    venv_bins = {str(Path(sys.prefix) / "bin")} if sys.prefix != sys.base_prefix else set()
    if os.environ.get("VIRTUAL_ENV"):
        venv_bins.add(str(Path(os.environ["VIRTUAL_ENV"]) / "bin"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "VERL_LAB_DIR")}
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p not in venv_bins)
    env["PYINFRA_PROGRESS"] = "off"
    # pip byte-compiles nothing it installs (issue 45: the module's CPU 64 -> 46 s, its pip 50 -> 29; its pyinfra runs
    # and bin/lab compile what they import, each time where PYTHONDONTWRITEBYTECODE is set, as on this machine;
    # docs/testing.md "Heavy processes"). `PIP_COMPILE=0`: `PIP_NO_COMPILE=1` would turn compiling on
    env["PIP_COMPILE"] = "0"
    return env


def test_readme_lab_path_as_written(tmp_path):
    why = requirements_missing()
    if why:
        pytest.skip(f"lab in a box unavailable: {why}")
    demo = readme_paragraphs()[0]
    repo = repo_copy(tmp_path / "verl-lab")
    log = tmp_path / "readme-path.log"
    started = time.monotonic()
    inventory_head = ""
    try:
        res = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", demo], cwd=repo, env=newcomer_env(),
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1500)
        took = time.monotonic() - started
        log.write_text(f"$ {demo}\n# rc {res.returncode} in {took:.0f}s\n--- stdout\n{res.stdout}\n"
                       f"--- stderr\n{res.stderr}\n")
        inv = repo / ".lab" / "inventory.py"
        inventory_head = inv.read_text().splitlines()[0] if inv.is_file() else ""
        if res.returncode == 0:
            # what a newcomer does next: a typo in `bin/lab up` on the provisioned lab (refused before
            # anything stops), then a re-run (nothing to change: one line per host of what it proved)
            after = subprocess.run(["bash", "-c", ". .venv/bin/activate && bin/lab up --gpus gtx1090; echo \"rc=$?\"; "
                                    "bin/lab plans && pyinfra -y .lab/inventory.py deploy/full.py"],
                                   cwd=repo, env=newcomer_env(), stdin=subprocess.DEVNULL, capture_output=True,
                                   text=True, timeout=900)
            log.write_text(log.read_text() + f"--- after\n{after.stdout}\n{after.stderr}\n")
    finally:
        python = repo / ".venv" / "bin" / "python"
        down = subprocess.run([str(python if python.exists() else "python3"), "bin/lab", "down"], cwd=repo,
                              env=newcomer_env(), capture_output=True, text=True, timeout=300)
    print(f"README lab path: rc {res.returncode} in {took:.0f}s (log {log})")
    assert res.returncode == 0, f"README's first command failed (log {log}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert down.returncode == 0 and not (repo / ".lab").exists(), down.stdout + down.stderr
    # the plan the box got, as bin/lab plans prints it: a P40 trains in fp32 with the HF rollout
    assert "p40: 1 x Tesla P40 (compute capability 6.1, 24576 MiB" in res.stdout, res.stdout
    assert "train fp32, rollout hf (float32)" in res.stdout
    assert "  model Qwen/Qwen2.5-0.5B-Instruct, rung ppo, full fine-tuning" in res.stdout, res.stdout
    assert re.search(r"predicted peak \d+ MiB of a \d+ MiB budget", res.stdout)
    assert "`bin/lab up` rewrites it" in inventory_head
    text = after.stdout + after.stderr
    assert "bin/lab: unknown GPU 'gtx1090' (did you mean gtx1080?)" in after.stderr and "rc=1" in after.stdout, text
    assert "stopping the lab" not in text, "the typo stopped the provisioned lab"
    assert after.returncode == 0, f"the lab did not survive the typo, or the re-run failed:\n{text[-3000:]}"
    summary = [line for line in after.stderr.splitlines() if line.startswith("verl-lab: p40 (")]
    assert len(summary) == 1, text[-3000:]
    assert ("base proven, cuda proven, env proven, data proven, train proven; changed nothing; plan "
            "Qwen/Qwen2.5-0.5B-Instruct, ppo, full fine-tuning, train fp32, rollout hf float32") in summary[0] and summary[0].endswith("; unit enabled"), summary
