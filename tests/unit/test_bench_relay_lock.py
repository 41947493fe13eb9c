"""Two hosts relaying the same artifact in one pyinfra process (gevent greenlets) must not
deadlock on the controller cache's file lock: tasks.artifacts.controller_copy serialises them
with a lock that yields, and the artifact leaves the mirror once. Found by bench/artifact_relay.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    from gevent import monkey
    monkey.patch_all()
    import hashlib, sys, types
    from pathlib import Path
    import gevent
    from tests.lab.mirror import Mirror
    from tasks import artifacts

    work = Path(sys.argv[1])
    body = bytes(range(256)) * 40000            # ~10 MB: many socket reads, many greenlet switches
    mirror = Mirror(work / "mirror").start()
    mirror.add_file("nvidia/x/blob.bin", body)
    art = types.SimpleNamespace(name="blob", version="1", filename="blob.bin", size=len(body),
                                sha256=hashlib.sha256(body).hexdigest(),
                                url=lambda mirrors: mirror.url + "/nvidia/x/blob.bin")
    settings = types.SimpleNamespace(controller_cache=work / "cache", mirrors=None)
    jobs = [gevent.spawn(artifacts.{fn}, settings, art) for _ in range({hosts})]
    done = gevent.joinall(jobs, timeout=20)
    if len(done) != len(jobs):
        print("DEADLOCK"); sys.exit(3)
    paths = {{str(j.get()) for j in jobs}}
    print("served", mirror.served("/nvidia/x/blob.bin"), len(body), len(paths))
""")


def run(tmp_path, fn="controller_copy", hosts=4):
    code = SCRIPT.replace("{fn}", fn).replace("{hosts}", str(hosts)).replace("{{", "{").replace("}}", "}")
    try:
        return subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True,
                              text=True, timeout=30, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        raise AssertionError("the hosts' downloads deadlocked (the whole process blocked in flock)") from None


def test_parallel_hosts_share_one_download(tmp_path):
    out = run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    served, size, paths = out.stdout.split()[1:]
    assert served == size and paths == "1"
