#!/usr/bin/env python3
"""A newcomer's first hour, run for real and written down: docs/newcomer.md.

    sudo .venv/bin/python tests/newcomer_transcript.py [--out docs/newcomer.md]

Runs, in this checkout (root, the lab's requirements; the venv of this Python on PATH, as
`. .venv/bin/activate` would put it):

1. README.md's first command as written (its ```bash block's first paragraph, without the venv
   line: this Python's venv is that venv): `bin/lab up --gpus p40`, the first converge, `bin/lab plans`;
2. what a newcomer tries next: a re-run (nothing to change: one line per host), a typo in `bin/lab up`
   on the provisioned lab (refused before anything stops), `bin/lab status`, `bin/lab up` on the running lab
   (refused without --replace), deploy/tracking.py (the lab's TensorBoard), deploy/status.py,
   deploy/doctor.py, `train_unit_state=started` (what the lab cannot do: there is no GPU), `stopped`;
3. each bad input of docs/refusals.md (the cases of tests/e2e/test_refusals.py, read from there), each one
   run of deploy/full.py against a second lab (`bin/lab up --gpus t4,p40,k80` in .lab-refusals/), with
   the same per-host data as the test.

Every command's exit status, seconds and output go into the document as they were printed, except
pyinfra's own progress lines and operation table (their line count is given; its lines naming
verl-lab or an error are kept): verl-lab's lines, the
status table and the doctor's report are kept whole. Both labs are stopped at the end (`bin/lab down`),
also on a failure. Refuses to start when .lab/ or .lab-refusals/ holds a lab already.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LAB, REFUSALS_LAB = REPO / ".lab", REPO / ".lab-refusals"


def readme_demo() -> list[str]:
    """The README's first paragraph of commands, less the venv line (this Python's venv is it)."""
    from tests.e2e.test_readme_path import commands, readme_paragraphs
    lines = commands(readme_paragraphs()[0])
    return [line for line in lines if "python3 -m venv" not in line]


def pyinfra_kept(text: str) -> tuple[list[str], int]:
    """pyinfra's output without its progress lines and its operation table (a host's line that names
    verl-lab or an error is kept, and so is pyinfra's error line); how many were left out."""
    kept, dropped, in_table = [], 0, False
    for line in text.splitlines():
        if line.startswith("    Operation ") or line.startswith("    Operation\t"):
            in_table = True
        told = ("verl-lab" in line or "rror" in line) and not line.startswith("--> Starting operation")
        if in_table or (line.startswith("--> ") and not told) or (line.startswith("    [") and not told) \
                or line.startswith("    Loading:") \
                or not line.strip() or line.strip().startswith("Detected changes may not include") \
                or line.startswith("    Hidden side effects") or line.startswith("    this will be shown") \
                or line.startswith("    to reflect the state"):
            dropped += 1
            if line.startswith("    Grand total"):
                in_table = False
            continue
        kept.append(line)
    return kept, dropped


class Transcript:
    def __init__(self):
        self.parts: list[str] = []
        bindir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "PYINFRA_PROGRESS": "off",
                    "NO_COLOR": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        self.env.pop("VERL_LAB_DIR", None)

    def say(self, text: str) -> None:
        self.parts.append(text.strip() + "\n")

    def run(self, command: str, why: str, env: dict | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
        started = time.monotonic()
        res = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=REPO, env={**self.env, **(env or {})},
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=timeout)
        took = time.monotonic() - started
        out = ANSI.sub("", res.stdout).replace(str(REPO) + "/", "./").replace(str(REPO), ".")   # any checkout's
        note = ""
        if "pyinfra" in command:
            lines, dropped = pyinfra_kept(out)
            note = f"; pyinfra's progress and operation table: {dropped} lines left out" if dropped else ""
        else:
            lines = out.splitlines()
        shown = (f"VERL_LAB_DIR={env['VERL_LAB_DIR']} ".replace(str(REPO) + "/", "./")
                 if env and env.get("VERL_LAB_DIR") else "")
        self.parts.append(f"{why}\n\n```text\n$ {shown}{command}\n" + "\n".join(lines)
                          + f"\n```\n*exit {res.returncode}, {took:.0f} s{note}*\n")
        print(f"[transcript] {command} -> {res.returncode} in {took:.0f}s", file=sys.stderr, flush=True)
        return res

    def text(self) -> str:
        return "\n".join(self.parts)


def case_inventory(path: Path, lab_inventory: Path, hosts: list[str], data: dict, per_host: dict) -> None:
    """An inventory with the lab's hosts named and their data merged with a case's (as the test does)."""
    path.write_text(
        '"""One bad input of docs/refusals.md on the lab of .lab-refusals/ (tests/newcomer_transcript.py)."""\n'
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('lab_inventory', {str(lab_inventory)!r})\n"
        "_lab = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(_lab)\n"
        + "".join(f"{h} = [(getattr(_lab, {h!r})[0][0], {{**getattr(_lab, {h!r})[0][1], **{data!r}, "
                  f"**{per_host.get(h, {})!r}}})]\n" for h in hosts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "newcomer.md")
    args = ap.parse_args(argv)
    from tests.lab import requirements_missing
    why = requirements_missing()
    if why:
        sys.exit(f"tests/newcomer_transcript.py: the lab cannot run here: {why}")
    for d in (LAB, REFUSALS_LAB):
        if (d / "state.json").exists():
            sys.exit(f"tests/newcomer_transcript.py: {d} holds a lab; stop it first (VERL_LAB_DIR={d} bin/lab down)")
    t = Transcript()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    t.say(f"""# A newcomer's first hour in the lab

Made by `tests/newcomer_transcript.py` (`sudo .venv/bin/python tests/newcomer_transcript.py` writes this
file again), not by hand: every command below ran as shown, on {started}, commit {rev}{' with local changes'
if dirty else ''}, on a 2-core machine shared with other work. pyinfra's progress lines and operation
table are left out of its runs (counted under each; its lines naming verl-lab or an error are kept), and
the Hugging Face client's progress bars are off (`HF_HUB_DISABLE_PROGRESS_BARS=1`), and paths in the
checkout are shown from its root (`./`); everything else each command printed is here.
The lab's boxes are real Debian hosts under systemd-nspawn; their GPUs are stand-ins (`nvidia-smi`
answers as the card would), so nothing here trains (see the end of part 2).

## 1. The README's first command

The README's first paragraph of commands, as written (`python3 -m venv .venv && ... pip install -e '.[test]'`
had already made the venv this runs in).""")
    demo_ok = True
    try:
        for command in readme_demo():
            for step in [s.strip() for s in command.split("&&")]:
                res = t.run(step, "")
                demo_ok = demo_ok and res.returncode == 0
                if res.returncode != 0:
                    break
        t.say("## 2. What a newcomer tries next")
        t.run("pyinfra -y .lab/inventory.py deploy/full.py",
              "A second run: nothing to change. It ends with one line per host: what each stage proved, the plan, "
              "the unit's state.")
        t.run("bin/lab up --gpus p40,gtx1090",
              "A typo in `bin/lab up` on the provisioned lab: the whole command is checked before anything is "
              "stopped.")
        t.run("bin/lab status", "The lab is still up:")
        t.run("bin/lab up --gpus p40",
              "`bin/lab up` again on the running lab: refused, since it would discard the provisioned box "
              "(`--replace` says to). Settings for the lab's boxes go in `.lab/group_data/all.py` instead.")
        t.run("pyinfra -y .lab/inventory.py deploy/tracking.py",
              "The lab's TensorBoard: every box's curves copied onto the hub (the inventory's first box) and served "
              "there; the lab's boxes share this machine's network, so status names the address to open here.")
        t.run("pyinfra -y .lab/inventory.py deploy/status.py", "The lab's status:")
        t.run("pyinfra -y .lab/inventory.py deploy/doctor.py", "The doctor:")
        t.run("pyinfra -y .lab/inventory.py deploy/full.py --data train_unit_state=started",
              "Training, asked for: the lab has no GPU (its torch is a CPU build standing in for torch+cu118), so "
              "the unit's preflight stops it and this box fails. Real training runs of these plans, on a lent "
              "H200: docs/training-runs.md.", timeout=1200)
        t.run("pyinfra -y .lab/inventory.py deploy/full.py --data train_unit_state=stopped",
              "Stopped again (a unit whose preflight fails would restart every 30 s):", timeout=1200)

        t.say("""## 3. Each bad input of docs/refusals.md

A second lab (a T4, a P40 and a K80; the stand-ins' driver is 535 on all three, where the test gives the
K80 driver 470), and each case of `tests/e2e/test_refusals.py` as one run of `deploy/full.py`, with that
case's per-host data (each case's inventory: `.lab-refusals/case-N.py`, the lab's inventory with the case's
data merged). The lab's HF stand-in serves every catalog model here.""")
        env = {"VERL_LAB_DIR": str(REFUSALS_LAB)}
        t.run("bin/lab up --gpus t4,p40,k80", "", env=env)
        from tests.e2e.test_refusals import CASES, EVERY_HOST
        cases = [(row, what, hosts, per_host) for row, what, hosts, per_host, _ in CASES]
        cases.append(("one run: a typo, vLLM on a P40, a batch no GPU takes, a K80",
                      "t4: mirror_profle, train_batch_size 10000; p40: rollout vllm, train_batch_size 10000; k80",
                      ["t4", "p40", "k80"], EVERY_HOST))
        for i, (row, what, hosts, per_host) in enumerate(cases, 1):
            inv = REFUSALS_LAB / f"case-{i}.py"
            case_inventory(inv, REFUSALS_LAB / "inventory.py", hosts, {}, per_host)
            t.run(f"pyinfra -y .lab-refusals/case-{i}.py deploy/full.py", f"**{row}**: `{what}`")
        t.run(f"pyinfra -y .lab-refusals/case-{len(cases)}.py deploy/full.py --limit p40",
              "The same run with `--limit p40`: only p40's problems.")
    finally:
        t.run("bin/lab down", "Both labs stopped:", env={"VERL_LAB_DIR": str(REFUSALS_LAB)})
        t.run("bin/lab down", "")
        args.out.write_text(t.text())
        print(f"[transcript] wrote {args.out}", file=sys.stderr)
    return 0 if demo_ok else 1


if __name__ == "__main__":
    sys.exit(main())
