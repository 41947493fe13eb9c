"""Fact: what a box's training run ended with: its checkpoints' exports and GSM8K scores, for
deploy/status.py and deploy/export.py (the files verl_lab_box/after_run.py, export.py and
gsm8k_score.py write into the checkpoint folder)."""

from __future__ import annotations

import json
import re
import shlex

from pyinfra.api import FactBase

from tasks.facts.logs import SECTION, _sections
from verl_lab_box.checkpoints import TRACKER, as_folder_owner, read_file

STEP_FILE = re.compile(r"/global_step_(\d+)/hf\.(proof|gsm8k)\.json$")
STEP_FILES = re.compile(r"/global_step_(\d+)/hf/$")        # the listing of an export's folder
SCORE_KEYS = ("accuracy", "correct", "rows", "prompts_per_s", "seconds", "engine", "dtype", "batch", "step", "final",
              "label", "max_new_tokens")
PROOF_KEYS = ("ok", "final", "export", "export_bytes", "export_dtype", "checkpoint_dtype", "fsdp_version", "world_size",
              "max_abs_logit_diff", "logit_tolerance", "proof_device", "merge_seconds", "proof_seconds")


class RunExports(FactBase[dict]):
    """``{"latest_step": verl's latest checkpoint or None, "finished_step": the step the launcher
    recorded the run finished at or None, "base": the base model's GSM8K score or None, "exports":
    [{"step", "proof": {...} or None, "score": {...} or None}] by step}`` of the checkpoint folder
    ``checkpoint_dir``; the default: nothing there.

    The files decide, not the proof's JSON alone: a proof counts (``"ok": True``) only where
    ``global_step_N/hf/`` holds exactly the files it lists (names and bytes, as
    verl_lab_box/checkpoints.py ``proven_export`` checks on the box); otherwise ``"ok"`` is False
    and ``"problem"`` says what differs (a deleted or changed ``hf/``)."""

    @staticmethod
    def default() -> dict:
        return {"latest_step": None, "finished_step": None, "base": None, "exports": []}

    def command(self, checkpoint_dir: str) -> str:
        """Read as the checkpoint folder's owner, each file without following a link or waiting on a FIFO
        (verl_lab_box/checkpoints.py ``as_folder_owner``, ``read_file``): the folder is the train user's."""
        d = shlex.quote(checkpoint_dir.rstrip("/"))
        read = {name: read_file(f'"$d/{name}"') for name in (TRACKER, "run-finished.json", "gsm8k-base.json")}
        each = read_file('"$f"')
        parts = [f"d={d}", f"echo '{SECTION}tracker'", f"({read[TRACKER]}; echo)",
                 # the launcher's JSON files end without a newline: the echo keeps the next section's line its own
                 f"echo '{SECTION}finished'", f"({read['run-finished.json']}; echo)",
                 f"echo '{SECTION}base'", f"({read['gsm8k-base.json']}; echo)",
                 'for f in "$d"/global_step_*/hf.proof.json "$d"/global_step_*/hf.gsm8k.json; do '
                 f'[ -f "$f" ] || continue; echo "{SECTION}$f"; {each}; echo; done',
                 'for s in "$d"/global_step_*; do [ -f "$s/hf.proof.json" ] || continue; '
                 f'echo "{SECTION}$s/hf/"; (cd "$s/hf" 2>/dev/null && find . -type f -printf ' + "'%P %s\\n' "
                 "| LC_ALL=C sort) || true; done"]     # no hf/ (deleted): an empty listing, never a failed command
        return as_folder_owner(checkpoint_dir.rstrip("/"), "; ".join(parts)) + "; true"

    def process(self, output) -> dict:
        sections = _sections(output)
        if not sections:
            return self.default()
        tracker = "".join(sections.get("tracker", [])).strip()
        finished = _json(sections.get("finished"))
        base = _json(sections.get("base"))
        exports: dict[int, dict] = {}
        listed = {int(m.group(1)): _listing(lines) for name, lines in sections.items() if (m := STEP_FILES.search(name))}
        for name, lines in sections.items():
            m = STEP_FILE.search(name)
            if not m:
                continue
            step = int(m.group(1))
            entry = exports.setdefault(step, {"step": step, "proof": None, "score": None})
            found = _json(lines)
            if m.group(2) == "proof":
                entry["proof"] = {k: found.get(k) for k in PROOF_KEYS} if found else None
                problem = _differs(found, listed.get(step)) if found else None
                if problem:
                    entry["proof"].update(ok=False, problem=problem)
            else:
                entry["score"] = {k: found.get(k) for k in SCORE_KEYS} if found else None
        return {"latest_step": int(tracker) if tracker.isdigit() else None,
                "finished_step": (finished or {}).get("step"),
                "base": {k: base.get(k) for k in SCORE_KEYS} if base else None,
                "exports": [exports[k] for k in sorted(exports)]}


def _json(lines) -> dict | None:
    text = "\n".join(lines or []).strip()
    try:
        found = json.loads(text) if text else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _listing(lines) -> dict[str, int]:
    """``find -printf '%P %s'``'s lines: {path under hf/: bytes}."""
    out = {}
    for line in lines or []:
        name, _, size = line.rstrip("\n").rpartition(" ")
        if name and size.isdigit():
            out[name] = int(size)
    return out


def _differs(proof: dict, listed: dict[str, int] | None) -> str | None:
    """What the export's folder lacks against its proof's file list, or None: it holds exactly those."""
    want = {f.get("name"): f.get("bytes") for f in proof.get("files") or [] if isinstance(f, dict)}
    if not listed:
        return "hf/ is missing or empty: the proof names an export that is not there"
    if listed != want:
        missing = sorted(set(want) - set(listed))
        changed = sorted(n for n in set(want) & set(listed) if want[n] != listed[n])
        extra = sorted(set(listed) - set(want))
        return (f"hf/ differs from its proof: missing {missing[:3]}, other bytes {changed[:3]}, not in the proof "
                f"{extra[:3]}")
    return None
