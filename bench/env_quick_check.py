"""The env's quick re-check: today's against the one with the lock and the trainer's imports, in one run.

    python bench/env_quick_check.py [--repeat 15]

One env, made here as a box's env is (tests/fixtures/standins/env.py ``overlay_env``: the cached CPU test env's
packages and the patched verl 0.5.0 installed editable), then ``--repeat`` interleaved rounds (a b c, b c a, ...)
of three arms, each a fresh process of that env's python, as the PythonEnv fact runs it (the program on stdin):

  before  : verl_lab_box/env_prove.py as it was at BASELINE (the RECORD scan, versions from metadata, Apex's
            files, verl's patched source)
  after   : env_lock.py + env_prove.py as the fact sends them now (the same, and the lock and the imports)
  import  : ``import verl.trainer.ppo.ray_trainer`` (what a check that imports the trainer would cost)

Prints the medians and the ratios against ``before``; writes bench/results/env_quick_check.json. No root, no lab.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import REPO, interleave, log, ratio, render_table, summary, write_result  # noqa: E402

BASELINE = "7eef346"           # main before the lock check (issue 44): today's quick check
BOX = REPO / "verl_lab_box"


def quick_expectations(verl_src: Path) -> dict:
    """The quick re-check's expectations for the CPU test env, with the lock the env stage gives it."""
    from tasks.env import BUILD_TOOLS, REQUIREMENTS, constraint_lines
    return {"quick": True, "torch": "2.13.0", "cuda": "none", "gpu_cc": None, "vllm": None, "vllm_skip": "bench",
            "verl": "0.5.0", "verl_src": str(verl_src), "compose": False, "overrides": [],
            "lock": constraint_lines(["torch==2.13.0"], REQUIREMENTS, BUILD_TOOLS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    from tests.fixtures.standins.env import overlay_env, patched_verl_tree

    before = subprocess.run(["git", "-C", str(REPO), "show", f"{BASELINE}:verl_lab_box/env_prove.py"],
                            capture_output=True, text=True, check=True).stdout
    after = (BOX / "env_lock.py").read_text() + "\n" + (BOX / "env_prove.py").read_text()
    with tempfile.TemporaryDirectory(prefix="env-quick-") as tmp:
        tmp = Path(tmp)
        log("making the env (the cached CPU test env's packages, verl 0.5.0 editable)")
        src = patched_verl_tree(tmp / "src")
        python = overlay_env(tmp / "env", src)
        want = json.dumps(quick_expectations(src))
        answers = {}

        def arm(name, program=None, code=None):
            def run():
                cmd = [str(python), "-", want] if program else [str(python), "-c", code]
                res = subprocess.run(cmd, input=program, capture_output=True, text=True, cwd=tmp, timeout=600)
                if res.returncode != 0:
                    raise SystemExit(f"{name}: exit {res.returncode}: {res.stderr[-800:]}")
                answers[name] = res.stdout
            return run

        arms = {"before": arm("before", before), "after": arm("after", after),
                "import": arm("import", code="import verl.trainer.ppo.ray_trainer")}
        arm("warm-up", after)()                 # the page cache holds the env's files for every arm alike
        times = interleave(arms, args.repeat, rotate=True)
    checks = json.loads(answers["after"].strip().splitlines()[-1])["checks"]
    base = summary(times["before"])["median"]
    rows = [(name, summary(t)["median"], summary(t)["min"], summary(t)["max"], ratio(summary(t)["median"], base))
            for name, t in times.items()]
    print(render_table(["arm", "median s", "min s", "max s", "x before"], rows))
    print(f"\nafter / before: {ratio(summary(times['after'])['median'], base):.2f}x "
          f"({args.repeat} interleaved rounds; lock: {checks['lock']['detail']}; imports: {checks['imports']['detail']})")
    path = write_result("env_quick_check", {"repeat": args.repeat, "baseline_commit": BASELINE,
                                            "seconds": {k: summary(v) for k, v in times.items()},
                                            "ratio_after_before": ratio(summary(times["after"])["median"], base),
                                            "lock": checks["lock"], "imports": checks["imports"]})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
