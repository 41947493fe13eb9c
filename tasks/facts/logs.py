"""Facts: the logs a failed run leaves on a box, for the doctor."""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase

SECTION = "=====verl-lab-section:"


class BoxLogs(FactBase[dict]):
    """The training unit's journal and state, the stage logs, and the box's plan.json.

    Returns ``{"sources": {name: text}, "unit_state": str, "plan": dict | None}``; the default,
    nothing read: no sources, no state, no plan.
    """

    @staticmethod
    def default() -> dict:
        return {"sources": {}, "unit_state": "", "plan": None}

    def command(self, unit: str, log_glob: str, plan_path: str, lines: int = 400) -> str:
        u, p = shlex.quote(unit), shlex.quote(plan_path)
        return "; ".join([
            f"echo '{SECTION}unit_state'",
            f"(systemctl show -p ActiveState -p Result --value {u} 2>/dev/null | tr '\\n' ' '; echo)",
            f"echo '{SECTION}journal'",
            f"(journalctl -u {u} --no-pager -o cat -n {int(lines)} 2>/dev/null || true)",
            f"for f in {log_glob} /var/log/cuda-installer.log; do [ -f \"$f\" ] || continue; "
            f"echo \"{SECTION}$f\"; tail -n {int(lines)} \"$f\"; done",
            f"echo '{SECTION}plan'",
            f"(cat {p} 2>/dev/null || true)",
        ])

    def process(self, output) -> dict:
        sections: dict[str, list[str]] = {}
        current = None
        for line in output:
            if line.startswith(SECTION):
                current = line[len(SECTION):].strip()
                sections[current] = []
            elif current is not None:
                sections[current].append(line)
        plan_text = "\n".join(sections.pop("plan", [])).strip()
        try:
            plan = json.loads(plan_text) if plan_text else None
        except ValueError:
            plan = None
        state = " ".join(sections.pop("unit_state", [])).strip()
        return {"sources": {k: "\n".join(v) for k, v in sections.items()}, "unit_state": state, "plan": plan}
