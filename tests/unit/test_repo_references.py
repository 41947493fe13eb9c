"""The code speaks of the repo only: no file points readers at design notes that live outside it.

A fact the code relies on is stated where it is used, or points at a doc or test in the repo
(docs/*.md, tests/...). Scanned: every file git tracks or would track (not ignored ones such as
.venv/, .lab/, .gpu/) whose name ends in a code or doc suffix, and the scripts under bin/ and .ci/.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".toml", ".j2", ".sh", ".md", ".cfg", ".ini", ".txt"}
SCRIPTS = ("bin/", ".ci/", "Makefile")
# Written in pieces so this file does not match itself.
OUTSIDE = ("FACTS" + ".md", "shared" + "/design", "../" + "shared/")


def repo_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    names = [n for n in out.split("\0") if n]
    return [REPO / n for n in names
            if Path(n).suffix in SUFFIXES or n.startswith(SCRIPTS)]


def test_scan_covers_the_code():
    names = {p.relative_to(REPO).as_posix() for p in repo_files()}
    assert {"tasks/plan/__init__.py", "config.py", "bin/lab", "files/doctor/rules.toml", "README.md"} <= names


def test_no_file_points_outside_the_repo():
    hits = []
    for path in repo_files():
        if not path.is_file():          # listed but deleted in the working tree
            continue
        text = path.read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for needle in OUTSIDE:
                if needle in line:
                    hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
                    break
    assert not hits, "references to documents outside the repo:\n" + "\n".join(hits)
