"""Facts: the logs a failed run leaves on a box, for the doctor; how a training run is doing,
for deploy/status.py and the doctor."""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase

SECTION = "=====verl-lab-section:"


class BoxLogs(FactBase[dict[str, str]]):
    """The logs a failed run leaves on a box, for the doctor (the training unit's journal is
    TrainingRun's): the stage logs (``log_glob``) and the CUDA installer's, and the journal of each
    of ``units`` that is installed, since the unit last became active (its current run, or every
    failed start since then: a Ray worker that lost its head fails and starts again, and why is in
    the runs before the current one), this boot, its last ``lines`` lines. Returns ``{name: text}``,
    named by the log's path or the unit; {} (the default) for none.
    """

    default = dict

    def command(self, log_glob: str, units: list[str] | tuple = (), lines: int = 400) -> str:
        parts = [f"for f in {log_glob} /var/log/cuda-installer.log; do [ -f \"$f\" ] || continue; "
                 f"echo \"{SECTION}$f\"; tail -n {int(lines)} \"$f\"; done"]
        for unit in units:
            u = shlex.quote(unit)
            parts.append(f"if [ \"$(systemctl show -p LoadState --value {u} 2>/dev/null)\" = loaded ]; then "
                         f"echo '{SECTION}{unit}'; since=$(TZ=UTC systemctl show -p ActiveEnterTimestamp --value {u}"
                         " 2>/dev/null | grep '[0-9]'); "
                         f"journalctl -u {u} -b --no-pager -o cat -n {int(lines)} ${{since:+--since \"$since\"}}"
                         " 2>/dev/null; fi")
        return "; ".join(parts)

    def process(self, output) -> dict[str, str]:
        return {name: "\n".join(lines) for name, lines in _sections(output).items()}


class TrainingRun(FactBase[dict]):
    """How the training unit is doing, for deploy/status.py: ``{"unit": {systemctl show property:
    value}, "markers": {stage: {key: value} | None}, "journal": text of the unit's current run (its
    step lines and last ``lines`` lines), "history": systemd's own journal lines about the unit this
    boot (Started, Main process exited, Failed with result, Deactivated successfully ...), "plan":
    plan.json | None, "preflight": the launcher's ``--check`` output, run as the train user only
    when the unit never ran, else ""}``; the default, nothing read: no unit, no markers, no journal,
    no history, no plan, no preflight.

    systemd forgets a run: a unit that is not enabled is unloaded once inactive (its start time,
    restarts and result read 0 again), and ``reset-failed`` turns a failed result into success. The
    journal keeps it: "current run" is the unit's invocation, or, where systemd has none, the last
    one the journal has this boot; "never ran" needs systemd and the journal both to say so
    (``tasks.status.unit_summary`` reads the history).
    """

    @staticmethod
    def default() -> dict:
        return {"unit": {}, "markers": {}, "journal": "", "history": "", "plan": None, "preflight": ""}

    def command(self, unit: str, markers: dict, plan_path: str, launcher: str, user: str, python: str,
                lines: int = 400, poll: int = 0, steps: bool = True) -> str:
        """``poll``: a new number asks again (facts are cached per arguments within a run);
        ``steps=False``: the journal's last ``lines`` lines only (the doctor), not every step line."""
        from tasks.status import UNIT_PROPERTIES

        u, q = shlex.quote(unit), shlex.quote
        keep = "/step:[0-9]+ - |Training Progress/ { print; next } " if steps else ""
        props = " ".join(f"-p {p}" for p in UNIT_PROPERTIES)
        parts = [f"echo '{SECTION}unit'", f"systemctl show {props} {u} 2>/dev/null"]
        for stage, path in markers.items():
            parts += [f"echo '{SECTION}marker:{stage}'", f"(cat {q(path)} 2>/dev/null || true)"]
        parts += [
            f"echo '{SECTION}journal'",
            f"inv=$(systemctl show -p InvocationID --value {u} 2>/dev/null)",
            # systemd forgot the run (an unloaded unit), or its last invocation printed nothing (a start
            # refused by the start limit): the last invocation of the unit that printed, this boot
            f"if [ -z \"$inv\" ] || [ -z \"$(journalctl _SYSTEMD_INVOCATION_ID=\"$inv\" -n 1 -o cat --no-pager"
            f" 2>/dev/null)\" ]; then inv=$(journalctl -u {u} -b -o export --no-pager 2>/dev/null"
            " | sed -n 's/^_SYSTEMD_INVOCATION_ID=//p' | tail -n 1); fi",
            f"if [ -n \"$inv\" ]; then journalctl _SYSTEMD_INVOCATION_ID=\"$inv\" --no-pager -o cat 2>/dev/null"
            f" | awk -v n={int(lines)} '{keep}{{ tail[NR % n] = $0 }}"
            f" END {{ for (i = NR - n + 1; i <= NR; i++) if (i > 0 && (i in tail)) print tail[i] }}'; fi",
            f"echo '{SECTION}history'",
            f"journalctl _PID=1 UNIT={u} -b -o cat --no-pager 2>/dev/null | tail -n 60",
            f"echo '{SECTION}plan'", f"(cat {q(plan_path)} 2>/dev/null || true)",
            f"echo '{SECTION}preflight'",
            f"if [ \"$(systemctl show -p ExecMainStartTimestampMonotonic --value {u} 2>/dev/null)\" = 0 ]"
            f" && [ \"$(systemctl show -p NRestarts --value {u} 2>/dev/null)\" = 0 ]"
            f" && ! journalctl _PID=1 UNIT={u} -b -o cat --no-pager 2>/dev/null | grep -q '^Started '"
            f" && [ -f {q(launcher)} ]; then"
            f" timeout 300 runuser -u {q(user)} -- {q(python)} {q(launcher)} --check 2>&1 | grep -v ' \\\\$' | tail -n 40; fi",
        ]
        return "; ".join(([f": poll {int(poll)}"] if poll else []) + parts)

    def process(self, output) -> dict:
        sections = _sections(output)
        if not sections:
            return self.default()
        unit = dict(line.partition("=")[::2] for line in sections.pop("unit", []) if "=" in line)
        markers = {}
        for name in [k for k in sections if k.startswith("marker:")]:
            found = dict(line.partition("=")[::2] for line in sections.pop(name) if "=" in line)
            markers[name[len("marker:"):]] = found or None
        return {"unit": unit, "markers": markers, "journal": "\n".join(sections.get("journal", [])) + "\n",
                "history": "\n".join(sections.get("history", [])),
                "plan": _plan(sections.get("plan", [])), "preflight": "\n".join(sections.get("preflight", []))}

def _sections(output) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in output:
        if line.startswith(SECTION):
            current = line[len(SECTION):].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


def _plan(lines: list[str]) -> dict | None:
    text = "\n".join(lines).strip()
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None
