"""The preloaded interpreter the unit tests run their programs under (tests/fixtures/zygote.py): a served program
behaves as a fresh ``python`` would (its output, exit code, traceback, sys.argv, sys.path, environment, signals), and
whatever it cannot start as a fresh one would (another environment, a module shadowed on its path, an import hook
over a preloaded module, a descriptor past stderr) runs fresh instead.

The mechanics on this Python with small standard modules preloaded (fast); last, the unit tests' env with verl's
stack preloaded, a program's output served and fresh compared. Served or fresh is told apart by the program's PID:
a fresh one is the process the test started (the shim execs the real interpreter), a served one is not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.zygote import PRELOAD, PYINFRA_PRELOAD, Served, Zygote

SMALL = ("json", "email.message", "decimal")
SHOW = ("import json, os, sys\n"
        "print(json.dumps({'pid': os.getpid(), 'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(),\n"
        "                  'x': os.environ.get('VERL_LAB_X'), 'pp': os.environ.get('PYTHONPATH'),\n"
        "                  'decimal': 'decimal' in sys.modules}))\n")


@pytest.fixture(scope="module")
def zygote():
    with Zygote(sys.executable, dict(os.environ), preload=SMALL) as z:
        yield z


def _run(z, argv, env=None, cwd=None, **kw):
    proc = subprocess.Popen([z.python, *argv], env=z.env if env is None else env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    out, err = proc.communicate(timeout=120)
    return proc, out, err


def _shown(proc, out) -> tuple[dict, bool]:
    found = json.loads(out.strip().splitlines()[-1])
    return found, found["pid"] != proc.pid


def test_a_served_program_gets_its_argv_path_cwd_and_output(zygote, tmp_path):
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    proc, out, err = _run(zygote, [str(script), "a", "b"], cwd=tmp_path)
    found, served = _shown(proc, out)
    assert served and proc.returncode == 0, err
    assert found["argv"] == [str(script), "a", "b"] and found["path0"] == str(tmp_path) and found["cwd"] == str(tmp_path)
    assert found["decimal"] is True                     # preloaded: loaded whether the program imports it or not
    proc, out, err = _run(zygote, ["-c", SHOW, "z"], cwd=tmp_path)
    found, served = _shown(proc, out)
    assert served and found["argv"] == ["-c", "z"] and found["path0"] == ""
    proc, out, err = _run(zygote, ["-m", "json.tool", "--help"], cwd=tmp_path)
    assert proc.returncode == 0 and "usage:" in out and err == ""


def test_exit_codes_and_tracebacks_are_a_fresh_interpreters(zygote, tmp_path):
    for code, want in (("import sys; sys.exit(3)", 3), ("import sys; sys.exit('bad')", 1), ("pass", 0),
                       ("raise ValueError('boom')", 1)):
        proc, out, err = _run(zygote, ["-c", code])
        fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == fresh.returncode == want
        assert err == fresh.stderr, (err, fresh.stderr)
    assert err.startswith('Traceback (most recent call last):\n  File "<string>", line 1')


def test_the_projects_variables_and_pythonpath_are_per_run_and_a_sitecustomize_there_is_imported(zygote, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['VERL_LAB_SITE'] = 'imported'\n")
    env = {**zygote.env, "VERL_LAB_X": "7", "PYTHONPATH": str(site)}
    code = "import os, sys; print(os.environ.get('VERL_LAB_SITE'), os.environ['VERL_LAB_X'], sys.path[1], os.getpid())"
    proc, out, err = _run(zygote, ["-c", code], env=env)
    site_said, x, path1, pid = out.split()
    assert (site_said, x, path1) == ("imported", "7", str(site)) and int(pid) != proc.pid, err


def test_another_environment_runs_fresh(zygote):
    env = {**zygote.env, "HF_HUB_OFFLINE": "1" if zygote.env.get("HF_HUB_OFFLINE") != "1" else "0"}
    proc, out, _ = _run(zygote, ["-c", SHOW], env=env)
    assert not _shown(proc, out)[1]


def test_a_module_shadowed_on_the_path_runs_fresh_and_finds_its_own(zygote, tmp_path):
    (tmp_path / "decimal.py").write_text("MINE = True\n")
    proc, out, _ = _run(zygote, ["-c", "import decimal, os; print(getattr(decimal, 'MINE', False), os.getpid())"],
                        cwd=tmp_path)
    mine, pid = out.split()
    assert mine == "True" and int(pid) == proc.pid
    # a bare folder of the name is no shadow (a regular package later on the path wins), and it is served
    (tmp_path / "decimal.py").unlink()
    (tmp_path / "json").mkdir()
    proc, out, _ = _run(zygote, ["-c", SHOW], cwd=tmp_path)
    assert _shown(proc, out)[1]


def test_an_import_hook_over_a_preloaded_module_runs_fresh(zygote, tmp_path):
    """A sitecustomize on PYTHONPATH that hooks a module's import (the GPU probe hooks torch when it caps memory)
    would never see a preloaded one imported: that run is fresh, and its hook fires."""
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, importlib.machinery, sys\n"
        "class Hook(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name != 'decimal':\n"
        "            return None\n"
        "        spec = importlib.machinery.PathFinder.find_spec(name, path)\n"
        "        inner = spec.loader\n"
        "        class Loader(importlib.abc.Loader):\n"
        "            def create_module(self, s):\n"
        "                return inner.create_module(s)\n"
        "            def exec_module(self, module):\n"
        "                inner.exec_module(module)\n"
        "                print('hooked', file=sys.stderr)\n"
        "        spec.loader = Loader()\n"
        "        return spec\n"
        "sys.meta_path.insert(0, Hook())\n")
    env = {**zygote.env, "PYTHONPATH": str(tmp_path)}
    proc, out, err = _run(zygote, ["-c", "import decimal, os; print(os.getpid())"], env=env)
    assert int(out) == proc.pid and "hooked" in err


def test_a_descriptor_past_stderr_runs_fresh(zygote):
    r, w = os.pipe()
    try:
        proc, out, _ = _run(zygote, ["-c", SHOW], pass_fds=(w,))
    finally:
        os.close(r)
        os.close(w)
    assert not _shown(proc, out)[1]


def test_a_signal_reaches_the_program_and_a_killed_shim_takes_it_along(zygote, tmp_path):
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('term', flush=True), sys.exit(5)))\n"
            "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
            "time.sleep(60)\n")
    pid_file = tmp_path / "pid"
    for how in ("term", "kill"):
        pid_file.unlink(missing_ok=True)
        proc = subprocess.Popen([zygote.python, "-c", code, str(pid_file)], stdout=subprocess.PIPE, text=True,
                                env=zygote.env)
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        program = int(pid_file.read_text())
        assert program != proc.pid, Path(zygote.log).read_text()
        if how == "term":
            proc.terminate()
            assert proc.wait(30) == 5 and proc.stdout.read() == "term\n"
        else:
            proc.kill()
            assert proc.wait(30) == -signal.SIGKILL
            deadline = time.monotonic() + 30
            while Path(f"/proc/{program}").exists() and "Z" not in Path(f"/proc/{program}/stat").read_text().split()[2]:
                assert time.monotonic() < deadline, "the program outlived its shim"
                time.sleep(0.05)
        proc.stdout.close()


def test_two_runs_at_once_and_the_server_leaves_nothing(tmp_path):
    z = Zygote(sys.executable, dict(os.environ), preload=SMALL)
    code = "import time, os; time.sleep(1); print(os.getpid())"
    started = time.monotonic()
    procs = [subprocess.Popen([z.python, "-c", code], stdout=subprocess.PIPE, text=True, env=z.env) for _ in range(2)]
    pids = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert time.monotonic() - started < 1.9 and len(set(pids)) == 2
    server, folder = z.server.pid, z.folder
    z.stop()
    assert not os.path.exists(folder) and not Path(f"/proc/{server}").exists()


def test_served_keeps_one_server_and_runs_other_environments_fresh():
    pool = Served(sys.executable, preload=SMALL)
    try:
        first = pool.python({**os.environ, "VERL_LAB_A": "1"})
        assert pool.python({**os.environ, "PYTHONPATH": "/nowhere"}) == first      # per-run variables only
        assert pool.python({**os.environ, "OTHER_SETTING": "x"}) == sys.executable
        assert len(pool.servers) == 1
    finally:
        pool.stop()


def test_a_pool_starts_servers_in_the_main_thread_only():
    """A server ends with the thread that started it (PR_SET_PDEATHSIG is the thread's): a pool asked from another
    thread for an environment it has no server for runs that one fresh; one started in the main thread serves there."""
    import threading

    pool = Served(sys.executable, preload=SMALL)
    got: list[str] = []
    try:
        worker = threading.Thread(target=lambda: got.append(pool.python({**os.environ, "VERL_LAB_A": "1"})))
        worker.start()
        worker.join()
        assert got == [sys.executable] and not pool.servers
        shim = pool.python()
        worker = threading.Thread(target=lambda: got.append(pool.python({**os.environ, "VERL_LAB_B": "2"})))
        worker.start()
        worker.join()
        assert got[1] == shim != sys.executable
        proc, out, err = _run(pool.servers[next(iter(pool.servers))], ["-c", SHOW])
        assert _shown(proc, out)[1], err                # served after its starting call returned
    finally:
        pool.stop()


def test_pyinfra_served_patches_and_deploys_as_fresh(tmp_path):
    """pyinfra's runs (tests/lab/lab.py): the server imported the ``pyinfra`` package and gevent's modules, not
    pyinfra_cli, so the program's own start does gevent's monkey-patching as a fresh ``python -m pyinfra`` does: a
    deploy sees the same patched socket, threading and subprocess, runs its operation and prints the same."""
    deploy = tmp_path / "deploy.py"
    deploy.write_text(
        "import os, socket, subprocess, threading, gevent.monkey\n"
        "from pyinfra.operations import server\n"
        "print('PROBE', os.getpid(), gevent.monkey.is_module_patched('socket'), type(socket.socket).__module__,\n"
        "      socket.socket.__module__, threading.Lock.__module__, subprocess.Popen.__module__, flush=True)\n"
        "server.shell(name='say hi', commands=[f'echo hi > {os.getcwd()}/{os.getpid()}.done'])\n")
    env = {**os.environ, "PYINFRA_PROGRESS": "off", "PYTHONUNBUFFERED": "1"}
    argv = ["-m", "pyinfra", "-y", "@local", str(deploy)]

    def probe(proc):
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE"))
        pid = int(line.split()[1])
        assert (tmp_path / f"{pid}.done").read_text() == "hi\n"     # the operation ran
        return pid, line.split()[2:], [x for x in (proc.stdout + proc.stderr).splitlines() if "say hi" in x]

    fresh = subprocess.Popen([sys.executable, *argv], env=env, cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fresh.stdout_, fresh.stderr_ = fresh.communicate(timeout=120)
    with Zygote(sys.executable, env, preload=PYINFRA_PRELOAD, timeout_s=120) as z:
        served = subprocess.Popen([z.python, *argv], env=env, cwd=tmp_path, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = served.communicate(timeout=120)
    pid, patched, ok = probe(subprocess.CompletedProcess(argv, served.returncode, out, err))
    fresh_pid, fresh_patched, fresh_ok = probe(subprocess.CompletedProcess(argv, fresh.returncode, fresh.stdout_,
                                                                           fresh.stderr_))
    assert fresh_pid == fresh.pid and pid != served.pid           # the first ran fresh, the second served
    assert patched == fresh_patched and patched[0] == "True" and patched[2].startswith("gevent"), patched
    assert ok == fresh_ok and ok


def test_verls_stack_served_prints_what_it_prints_fresh(verl_python, tmp_path):
    """torch and transformers preloaded: a program's output is a fresh interpreter's (threads, versions, its
    interpreter and path), and its random generators are seeded afresh each run as a fresh one's are (torch's and
    numpy's from the OS)."""
    code = ("import os, sys, numpy, torch, transformers\n"
            "print(torch.get_num_threads(), torch.get_num_interop_threads(), transformers.__version__, sys.executable,\n"
            "      sys.path[0], torch.utils.data.get_worker_info())\n")
    seeds = "import numpy, torch; print(torch.initial_seed(), numpy.random.randint(1 << 30))"
    env = dict(os.environ)
    fresh = subprocess.run([str(verl_python), "-c", code], capture_output=True, text=True, env=env, timeout=300)
    fresh_seeds = [subprocess.run([str(verl_python), "-c", seeds], capture_output=True, text=True, env=env).stdout.split()
                   for _ in range(2)]
    with Zygote(verl_python, env, preload=PRELOAD) as z:
        served = subprocess.run([z.python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        served_seeds = [subprocess.run([z.python, "-c", seeds], capture_output=True, text=True, env=env).stdout.split()
                        for _ in range(2)]
    assert fresh.returncode == served.returncode == 0, served.stderr[-2000:]
    assert served.stdout == fresh.stdout
    for pair in (fresh_seeds, served_seeds):
        assert pair[0][0] != pair[1][0] and pair[0][1] != pair[1][1], pair


def test_a_killed_starter_takes_its_server_along(tmp_path):
    """A pytest worker killed before its fixture could stop the server: the server ends too (it is in a session of
    its own, out of the worker's signals); its folder lies under the given parent (pytest's base folder)."""
    repo = str(Path(__file__).resolve().parents[2])
    code = (f"import os, sys, time; sys.path.insert(0, {repo!r}); from tests.fixtures.zygote import Zygote\n"
            f"z = Zygote(sys.executable, dict(os.environ), preload=('json',), parent={str(tmp_path)!r})\n"
            "print(z.server.pid, flush=True); time.sleep(120)\n")
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server = int(starter.stdout.readline())
    assert [p.parent for p in tmp_path.glob("zy*/s")] and Path(f"/proc/{server}").exists()
    starter.kill()
    starter.wait()
    starter.stdout.close()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{server}").exists() and "Z" not in Path(f"/proc/{server}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the server outlived the process that started it"
        time.sleep(0.05)


EDGES = {   # name: (argv after the interpreter, Popen's extra arguments): each served as fresh runs it (attack findings)
    "__main__ kept for atexit": (["-c", "import atexit\nX = 7\natexit.register(lambda: print(__import__('__main__').X))"], {}),
    "-c compiled without this file's __future__": (["-c", "def f(x: not_defined): pass"], {}),
    "an uncaught KeyboardInterrupt ends by SIGINT": (["-c", "raise KeyboardInterrupt"], {}),
    "an exit code past a C long": (["-c", "import sys; sys.exit(2 ** 70)"], {}),
    "the caller's umask and limits": (["-c", "import os, resource; print(oct(os.umask(0)),"
                                       " resource.getrlimit(resource.RLIMIT_NOFILE))"],
                                      {"preexec_fn": lambda: (os.umask(0o077),
                                                              __import__("resource").setrlimit(
                                                                  __import__("resource").RLIMIT_NOFILE, (99, 99)))}),
    "an ignored SIGHUP stays ignored": (["-c", "import os, signal; os.kill(os.getpid(), signal.SIGHUP); print('alive')"],
                                       {"preexec_fn": lambda: __import__("signal").signal(
                                           __import__("signal").SIGHUP, __import__("signal").SIG_IGN)}),
    "stdin's newlines as they come": (["-c", "import sys; print(repr(sys.stdin.read()), sys.stdout.name,"
                                       " sys.stdout.errors)"], {"input": "a\r\nb\rc\n"}),
}


@pytest.mark.parametrize("name", EDGES)
def test_edges_run_as_a_fresh_interpreter_runs_them(zygote, tmp_path, name):
    argv, extra = EDGES[name]
    kw = {"capture_output": True, "text": True, "cwd": tmp_path, "env": zygote.env, "timeout": 60, **extra}
    served = subprocess.run([zygote.python, *argv], **kw)
    fresh = subprocess.run([sys.executable, *argv], **kw)
    assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_relative_script_gets_an_absolute_file_and_its_own_main(zygote, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "s.py").write_text("import __main__, os, threading\n"
                                           "def late():\n    print(__file__, __main__.__dict__.get('MARK'), os.getpid())\n"
                                           "MARK = 'mine'\nthreading.Timer(0.2, late).start()\n")
    proc, out, err = _run(zygote, ["sub/s.py"], cwd=tmp_path)
    where, mark, pid = out.split()
    assert (where, mark) == (str(tmp_path / "sub" / "s.py"), "mine") and int(pid) != proc.pid, err


def test_a_caller_that_gives_it_a_group_or_closes_a_stdio_descriptor_gets_a_fresh_one(zygote, tmp_path):
    proc, out, _ = _run(zygote, ["-c", SHOW], start_new_session=True)       # killpg must reach its children
    assert not _shown(proc, out)[1]
    shell = subprocess.run(["sh", "-c", f'exec "{zygote.python}" -c "import os, sys; print(os.getpid(), sys.stdin)" <&-'],
                           capture_output=True, text=True, env=zygote.env, timeout=60)
    assert shell.stdout.split()[1:] == ["None"], shell.stderr


def test_a_signal_right_after_the_start_is_never_lost(zygote, tmp_path):
    """Sent as soon as the program says it is ready: it reaches the program's handler every time (a shim that
    installed its forwarding late lost it, or died of it with the program left running)."""
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    for _ in range(15):
        proc = subprocess.Popen([zygote.python, "-c", code], stdout=subprocess.PIPE, text=True, env=zygote.env)
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 5
        proc.stdout.close()


def test_a_programs_own_children_start_fresh_unless_asked(zygote):
    code = ("import os, subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import os; print(os.getpid())'], stdout=subprocess.PIPE,"
            " text=True)\n"
            "print(os.path.basename(sys.executable), child.pid == int(child.communicate()[0]))\n")
    fresh = subprocess.run([zygote.python, "-c", code], capture_output=True, text=True, env=zygote.env, timeout=60)
    served = subprocess.run([zygote.python_serving_children, "-c", code], capture_output=True, text=True,
                            env=zygote.env, timeout=60)
    assert fresh.stdout.split() == [os.path.basename(sys.executable), "True"], fresh.stderr
    assert served.stdout.split() == ["python-serving-children", "False"], served.stderr


def test_a_server_that_cannot_start_leaves_the_programs_to_run_fresh(tmp_path, capsys):
    pool = Served(sys.executable, preload=SMALL, timeout_s=0)
    try:
        assert pool.python() == sys.executable       # not ready in no time: refused, and every run fresh after
        assert pool.python({**os.environ, "OTHER": "1"}) == sys.executable and not pool.servers
    finally:
        pool.stop()
    assert "zygote: the zygote did not start" in capsys.readouterr().err


def test_the_second_attacks_edges(zygote, tmp_path):
    """A re-attack after the mends found these; each as a fresh interpreter does it."""
    # a SIGINT in the program's first milliseconds ends it by SIGINT (or 1 with the traceback), never 0 silently (it
    # landed between the fork and the program's code). CPython's own start of the shim's script stays, where it
    # swallows one and says so, as for any `python SCRIPT`: "Failed checking if argv[0] is an import path entry", or
    # "Exception ignored in" an import's callback
    for delay in (0.0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04) * 12:
        proc = subprocess.Popen([zygote.python, "-c", "import time; time.sleep(3)"], env=zygote.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=20)[1]
        swallowed = "Failed checking if argv[0]" in err or ("Exception ignored in" in err and "KeyboardInterrupt" in err)
        assert proc.returncode in (-signal.SIGINT, 1) or swallowed, (delay, err)
    # a signal the caller ignores reaches a program that then handles it
    code = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(4))\n"
            "print('ready', flush=True)\ntime.sleep(20)\n")
    proc = subprocess.Popen([zygote.python, "-c", code], env=zygote.env, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 4
    proc.stdout.close()
    # killed from outside by SIGKILL: -9; and a program may start a session of its own
    proc = subprocess.Popen([zygote.python, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(20)"],
                            env=zygote.env, stdout=subprocess.PIPE, text=True)
    os.kill(int(proc.stdout.readline()), signal.SIGKILL)
    assert proc.wait(20) == -signal.SIGKILL
    proc.stdout.close()
    proc, out, err = _run(zygote, ["-c", "import os; os.setsid(); print('ok')"])
    assert (proc.returncode, out) == (0, "ok\n"), err
    # a working directory gone before the run: fresh
    gone = tmp_path / "gone"
    gone.mkdir()
    shell = subprocess.run(["sh", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "{zygote.python}" -c "print(1)"'],
                           capture_output=True, text=True, env=zygote.env, timeout=60)
    assert (shell.returncode, shell.stdout) == (0, "1\n"), shell.stderr
    # stdout that cannot be flushed at the end (no PYTHONUNBUFFERED): said, and 120
    env = {k: v for k, v in zygote.env.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        served = subprocess.run([zygote.python, "-c", "print('x')"], stdout=full, stderr=subprocess.PIPE, text=True,
                                env=env, timeout=60)
        fresh = subprocess.run([sys.executable, "-c", "print('x')"], stdout=full, stderr=subprocess.PIPE, text=True,
                               env=env, timeout=60)
    assert served.returncode == fresh.returncode == 120 and "No space left on device" in served.stderr


def test_stop_ends_the_programs_still_running_and_a_bad_python_is_refused(tmp_path):
    z = Zygote(sys.executable, dict(os.environ), preload=SMALL)
    proc = subprocess.Popen([z.python, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(30)"],
                            env=z.env, stdout=subprocess.PIPE, text=True)
    program = int(proc.stdout.readline())
    z.stop()
    proc.wait(30)
    proc.stdout.close()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{program}").exists() and "Z" not in Path(f"/proc/{program}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "a program outlived its zygote's stop"
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="did not start"):
        Zygote(str(tmp_path / "no-python"), dict(os.environ), preload=SMALL, parent=str(tmp_path))
    assert not list(tmp_path.glob("zy*"))
