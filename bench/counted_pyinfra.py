"""Run the real pyinfra CLI, recording every remote command it sends to a host.

    VERL_LAB_COMMAND_LOG=/tmp/cmds.jsonl python bench/counted_pyinfra.py -y INV deploy/full.py

Same arguments as ``python -m pyinfra``. Each ``Host.run_shell_command`` and ``Host.put_file``
(the single doorway every fact and operation goes through to the connector) appends one JSON
line: host, kind ("fact", "op" or "upload"), the fact class when a fact asked for it, the
stage (the top-level @deploy it belongs to), the tasks/ module whose code led to the call (when
the call comes from a stage's own code rather than a pyinfra operation), the operation running
(while executing), the command text and how long the call took. Nothing
else changes: the command still runs exactly as it would.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASKS = str(REPO / "tasks") + os.sep
DEPLOY = str(REPO / "deploy") + os.sep


def _stage(host) -> str | None:
    """The top-level @deploy the call belongs to ("verl-lab CUDA 11.8 + cuDNN 8.9", ...): while
    operations are prepared, the host's current deploy; while they execute, the operation's name."""
    name = host.current_deploy_name
    if not name and host.current_op_hash:
        try:
            names = sorted(host.state.get_op_meta(host.current_op_hash).names)
            name = names[0] if names else None
        except Exception:  # noqa: BLE001 - attribution only
            name = None
    return name.split(" | ")[0] if name else None


def _origin() -> tuple[str | None, str | None]:
    """(fact name, tasks module) from the current call stack."""
    fact = stage = None
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if fact is None and code.co_name == "_get_fact" and "pyinfra" in code.co_filename:
            fact = frame.f_locals.get("name")
        fn = code.co_filename
        if stage is None and fn.startswith(TASKS) and os.sep + "facts" + os.sep not in fn[len(TASKS) - 1:]:
            stage = Path(fn[len(TASKS):]).with_suffix("").as_posix().replace("/", ".")   # driver.stage, cuda
        frame = frame.f_back
    return fact, stage


def _op_name(host) -> str | None:
    if not host.current_op_hash:
        return None
    try:
        names = sorted(host.state.get_op_meta(host.current_op_hash).names)
    except Exception:  # noqa: BLE001 - attribution only
        return None
    return names[0] if names else None


def install(log_path: str) -> None:
    from pyinfra.api.host import Host

    lock = threading.Lock()
    out = open(log_path, "a", buffering=1)
    run_shell_command, put_file = Host.run_shell_command, Host.put_file

    def write(rec: dict) -> None:
        with lock:
            out.write(json.dumps(rec) + "\n")

    def counted_run(self, command, *args, **kwargs):
        fact, module = _origin()
        stage, op = _stage(self), _op_name(self)
        try:
            text = command.get_raw_value() if hasattr(command, "get_raw_value") else str(command)
        except Exception:  # noqa: BLE001 - a command that cannot render is still counted
            text = repr(command)
        started = time.monotonic()
        try:
            return run_shell_command(self, command, *args, **kwargs)
        finally:
            write({"host": self.name, "kind": "fact" if fact else "op", "fact": fact, "stage": stage,
                   "module": module, "op": op, "command": text[:400],
                   "seconds": round(time.monotonic() - started, 4)})

    def counted_put(self, filename_or_io, remote_filename, *args, **kwargs):
        _, module = _origin()
        stage, op = _stage(self), _op_name(self)
        started = time.monotonic()
        try:
            return put_file(self, filename_or_io, remote_filename, *args, **kwargs)
        finally:
            write({"host": self.name, "kind": "upload", "fact": None, "stage": stage, "module": module,
                   "op": op, "command": str(remote_filename), "seconds": round(time.monotonic() - started, 4)})

    Host.run_shell_command = counted_run
    Host.put_file = counted_put


if __name__ == "__main__":
    path = os.environ.get("VERL_LAB_COMMAND_LOG")
    if path:
        install(path)
    sys.argv[0] = "pyinfra"
    from pyinfra_cli.main import main
    main()
