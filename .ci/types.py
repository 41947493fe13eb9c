"""Types: mypy over tasks/ and verl_lab_box/ (pyproject.toml's [tool.mypy]), held to a baseline that only shrinks.

    python .ci/types.py [PATH ...]        # the project's own paths where none are given
    python .ci/types.py --cut             # write the baseline without the errors no longer found

- An error in a pure layer (``PURE``: the plan, the memory model, the settings, the speed and checkpoint models, the
  catalog) fails, always: those layers are clean and stay so.
- Any other error fails unless ``.ci/mypy-baseline.txt`` lists it. An entry is the file, mypy's message and its code,
  not the line, so an edit above an error does not move it; a file's message listed twice allows two.
- An entry no longer found is said ("the baseline can shrink by N"); ``--cut`` writes the baseline without it. No
  command adds an entry: a new one is written by hand, where the review sees it.

docs/testing.md, "Lint and types", says what runs and how to shrink the baseline.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / ".ci" / "mypy-baseline.txt"
PATHS = ("tasks", "verl_lab_box")
PURE = ("tasks/plan/", "tasks/memory/", "tasks/settings/", "tasks/speed.py", "tasks/checkpoints.py", "tasks/catalog.py")
ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):(?P<line>\d+): error: (?P<message>.*?)  \[(?P<code>[a-z0-9-]+)\]$")
HEADER = ("# mypy's errors outside the pure layers, held here until fixed (.ci/types.py; docs/testing.md, \"Lint and\n"
          "# types\"): one a line, file: message  [code]. Fix one, then `python .ci/types.py --cut`.\n")


def entry(path: str, message: str, code: str) -> str:
    """An error as the baseline lists it: without its line, and without the lines its message names."""
    return f"{path}: {re.sub(r'on line [0-9]+', 'on line N', message)}  [{code}]"


def mypy_errors(paths: list[str]) -> tuple[list[tuple[str, int, str]], str]:
    """(file, line, entry) of each error mypy reports over ``paths``, and its output; exits where mypy itself failed
    (a crash, a bad config: exit status 2)."""
    run = subprocess.run([sys.executable, "-m", "mypy", *paths], cwd=ROOT, capture_output=True, text=True)
    if run.returncode not in (0, 1):
        sys.exit(f"mypy failed (exit {run.returncode}):\n{run.stdout}{run.stderr}")
    found = [(m["path"], int(m["line"]), entry(m["path"], m["message"], m["code"]))
             for m in map(ERROR.match, run.stdout.splitlines()) if m]
    if run.returncode == 1 and not found:
        sys.exit(f"mypy reported errors this script cannot read:\n{run.stdout}{run.stderr}")
    return found, run.stdout


def baseline() -> Counter:
    if not BASELINE.exists():
        return Counter()
    return Counter(line for line in BASELINE.read_text().splitlines() if line and not line.startswith("#"))


def judge(found: list[tuple[str, int, str]], allowed: Counter) -> tuple[list[str], Counter]:
    """The errors that fail (in a pure layer, or beyond the baseline's count of their entry, each with its line), and
    the baseline's entries no longer found."""
    failing, seen = [], Counter()
    for path, line, text in found:
        seen[text] += 1
        if path.startswith(PURE):
            failing.append(f"{path}:{line}: in a pure layer (no baseline there): {text}")
        elif seen[text] > allowed[text]:
            failing.append(f"{path}:{line}: not in .ci/mypy-baseline.txt: {text}")
    return failing, allowed - seen


def main(argv: list[str]) -> int:
    cut = "--cut" in argv
    paths = [a for a in argv if a != "--cut"] or [p for p in PATHS if (ROOT / p).exists()]
    found, output = mypy_errors(paths)
    allowed = baseline()
    failing, gone = judge(found, allowed)
    if cut:
        if failing or paths != list(PATHS):
            sys.exit("--cut: only over the whole project, with no error beyond the baseline")
        kept = allowed - gone
        BASELINE.write_text(HEADER + "".join(f"{e}\n" for e in sorted(kept.elements())))
        print(f"types: the baseline cut by {sum(gone.values())} to {sum(kept.values())}")
        return 0
    if failing:
        print(output, end="")
        print(f"types: {len(failing)} error(s) beyond what is allowed:", *failing, sep="\n  ")
        return 1
    print(f"types: mypy clean over the pure layers; {len(found)} error(s) elsewhere, each in the baseline "
          f"({sum(allowed.values())} listed)")
    if gone and paths == list(PATHS):
        print(f"types: the baseline can shrink by {sum(gone.values())}: python .ci/types.py --cut")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
