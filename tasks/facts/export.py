"""Fact: what a box's training run ended with: its checkpoints' exports and GSM8K scores, for
deploy/status.py and deploy/export.py (the files verl_lab_box/train_launcher.py, export.py and
gsm8k_score.py write into the checkpoint folder)."""

from __future__ import annotations

import json
import re
import shlex

from pyinfra.api import FactBase

from tasks.facts.logs import SECTION, _sections

STEP_FILE = re.compile(r"/global_step_(\d+)/hf\.(proof|gsm8k)\.json$")
SCORE_KEYS = ("accuracy", "correct", "rows", "prompts_per_s", "seconds", "engine", "dtype", "batch", "step", "final",
              "label", "max_new_tokens")
PROOF_KEYS = ("ok", "final", "export", "export_bytes", "export_dtype", "checkpoint_dtype", "fsdp_version", "world_size",
              "max_abs_logit_diff", "logit_tolerance", "proof_device", "merge_seconds", "proof_seconds")


class RunExports(FactBase[dict]):
    """``{"latest_step": verl's latest checkpoint or None, "finished_step": the step the launcher
    recorded the run finished at or None, "base": the base model's GSM8K score or None, "exports":
    [{"step", "proof": {...} or None, "score": {...} or None}] by step}`` of the checkpoint folder
    ``checkpoint_dir``; the default: nothing there."""

    @staticmethod
    def default() -> dict:
        return {"latest_step": None, "finished_step": None, "base": None, "exports": []}

    def command(self, checkpoint_dir: str) -> str:
        d = shlex.quote(checkpoint_dir.rstrip("/"))
        parts = [f"echo '{SECTION}tracker'", f"(cat {d}/latest_checkpointed_iteration.txt 2>/dev/null; echo)",
                 # the launcher's JSON files end without a newline: the echo keeps the next section's line its own
                 f"echo '{SECTION}finished'", f"(cat {d}/run-finished.json 2>/dev/null; echo)",
                 f"echo '{SECTION}base'", f"(cat {d}/gsm8k-base.json 2>/dev/null; echo)",
                 f"for f in {d}/global_step_*/hf.proof.json {d}/global_step_*/hf.gsm8k.json; do "
                 f"[ -f \"$f\" ] || continue; echo \"{SECTION}$f\"; cat \"$f\"; echo; done"]
        return "; ".join(parts)

    def process(self, output) -> dict:
        sections = _sections(output)
        if not sections:
            return self.default()
        tracker = "".join(sections.get("tracker", [])).strip()
        finished = _json(sections.get("finished"))
        base = _json(sections.get("base"))
        exports: dict[int, dict] = {}
        for name, lines in sections.items():
            m = STEP_FILE.search(name)
            if not m:
                continue
            entry = exports.setdefault(int(m.group(1)), {"step": int(m.group(1)), "proof": None, "score": None})
            found = _json(lines)
            if m.group(2) == "proof":
                entry["proof"] = {k: found.get(k) for k in PROOF_KEYS} if found else None
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

