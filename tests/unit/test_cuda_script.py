"""The box-side install script (files/templates/cuda-install.sh.j2), rendered as pyinfra renders it
and run here inside a temp folder against the stand-in runfile and cuDNN archive.

The stand-in runfile's CUDA_STANDIN_ROOT and the script's link/log paths point every absolute
path it would touch (/usr/local/cuda, /tmp and /var/log installer logs) into the temp folder.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pyinfra.api.util import get_template

from tasks import cuda
from tasks.cuda import CudaFacts, cuda_want, plan_cuda, script_values
from tasks.facts.nvidia import IN_PROGRESS
from tasks.settings import load_settings
from tasks.target import decide_compiler
from tests.fixtures.standins import cuda as standin

ROOMY = {"filesystem": "/dev/x", "mount": "/", "free_mib": 10 ** 6, "size_mib": 10 ** 6}


class Rig:
    def __init__(self, tmp: Path, step: float = 0.05):
        self.tmp = tmp
        self.root = tmp / "root"                       # stands for the box's /
        (self.root / "tmp").mkdir(parents=True)
        (self.root / "usr" / "local").mkdir(parents=True)
        self.overrides = standin.publish(tmp / "mirror", step_seconds=step)
        s = load_settings("unit", {"cuda_prefix": str(tmp / "cuda-11.8"), "install_tmpdir": str(tmp / "vartmp"),
                                   "lab_root": str(tmp / "lab"), "catalog_overrides": self.overrides})
        self.want = cuda_want(s)
        self.link = self.root / "usr" / "local" / "cuda"
        Path(self.want.runfile_path).parent.mkdir(parents=True)
        Path(self.want.cudnn_path).parent.mkdir(parents=True)
        os.replace(standin.mirror_path(tmp / "mirror", "cuda_runfile"), self.want.runfile_path)
        os.replace(standin.mirror_path(tmp / "mirror", "cudnn_archive"), self.want.cudnn_path)
        self.script = tmp / "install.sh"

    def render(self, action: str = "install") -> Path:
        facts = CudaFacts(os_release={"ID": "debian", "VERSION_ID": "12"}, driver=None,
                          toolkits={"link": None, "toolkits": {}}, disk={}, compiler=decide_compiler({}, {"gcc": "10.2.1"}),
                          marker=None, cached=frozenset({"cuda_runfile", "cudnn_archive"}))
        plan = plan_cuda(dataclasses.replace(self.want, allow_no_driver=True), facts)
        plan = dataclasses.replace(plan, action=action)
        values = script_values(self.want, plan, cuda_link=str(self.link),
                               installer_tmp_log=str(self.root / "tmp" / "cuda-installer.log"),
                               installer_log=str(self.root / "var" / "log" / "cuda-installer.log"),
                               private_tmp=False)     # the rig's files lie under /tmp
        self.script.write_text(get_template(str(cuda.TEMPLATE)).render(**values))
        return self.script

    def env(self):
        return {**os.environ, "CUDA_STANDIN_ROOT": str(self.root)}

    def run(self, action: str = "install") -> subprocess.CompletedProcess:
        self.render(action)
        return subprocess.run(["sh", str(self.script)], capture_output=True, text=True, env=self.env(), timeout=120)

    @property
    def prefix(self) -> Path:
        return Path(self.want.prefix)

    def marker(self) -> dict | None:
        path = Path(self.want.marker)
        if not path.exists():
            return None
        return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.fixture
def rig(tmp_path):
    return Rig(tmp_path)


def test_fresh_install_proves_and_marks(rig):
    res = rig.run()
    assert res.returncode == 0, res.stderr
    assert "Cuda compilation tools, release 11.8, V11.8.89" in subprocess.run(
        [str(rig.prefix / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    lib64 = rig.prefix / "lib64"
    assert os.readlink(lib64 / "libcudnn.so") == "libcudnn.so.8"
    assert os.readlink(lib64 / "libcudnn.so.8") == "libcudnn.so.8.9.7"
    assert (lib64 / "libcudnn.so.8.9.7").is_file() and not (lib64 / "libcudnn.so.8.9.7").is_symlink()
    assert "#define CUDNN_PATCHLEVEL 7" in (rig.prefix / "include" / "cudnn_version.h").read_text()
    marker = rig.marker()
    assert marker["nvcc_version"] == "11.8.89" and marker["cudnn_header"] == "8.9.7"
    assert marker["cudnn_version"] == "8.9.7.29" and marker["prefix"] == str(rig.prefix)
    assert marker["runfile_sha256"] == rig.overrides["cuda_runfile"]["sha256"]
    assert marker["cudnn_sha256"] == rig.overrides["cudnn_archive"]["sha256"]
    assert not (rig.prefix / IN_PROGRESS).exists()
    # there was no /usr/local/cuda: the one the runfile made is gone again
    assert not rig.link.is_symlink() and "created" in res.stdout
    # artifacts removed from the box cache after the verified install; tmpdir cleaned
    assert not Path(rig.want.runfile_path).exists() and not Path(rig.want.cudnn_path).exists()
    assert not Path(rig.want.workdir).exists()
    # the runfile's own log is where the real one puts it
    assert (rig.root / "var" / "log" / "cuda-installer.log").is_file()


def test_existing_link_restored_and_other_toolkit_untouched(rig):
    other = standin.fake_toolkit(rig.root, "12.4")
    os.remove(rig.link)
    rig.link.symlink_to(str(other))
    before = standin.tree_digest(other)
    res = rig.run()
    assert res.returncode == 0, res.stderr
    assert os.readlink(rig.link) == str(other)
    assert standin.tree_digest(other) == before
    assert "restored it to" in res.stdout
    assert rig.marker()["cuda_link"] == f"link:{other}"


def test_stale_installer_log_removed_first(rig):
    stale = rig.root / "tmp" / "cuda-installer.log"
    stale.write_text("old\n")
    os.chown(stale, 12345, 12345)  # another user's: the runfile would crash on it
    res = rig.run()
    assert res.returncode == 0, res.stderr


def test_runfile_failure_fails_without_marker(rig):
    # a tmpdir the runfile cannot use
    rig.render()
    text = rig.script.read_text().replace('mkdir -p "$WORK/runfile" "$WORK/cudnn"', 'mkdir -p "$WORK/cudnn"')
    rig.script.write_text(text)
    res = subprocess.run(["sh", str(rig.script)], capture_output=True, text=True, env=rig.env())
    assert res.returncode != 0 and "the CUDA runfile failed" in res.stderr
    assert rig.marker() is None and (rig.prefix / IN_PROGRESS).exists()


def test_killed_runfile_is_detected_and_redone(tmp_path):
    rig = Rig(tmp_path, step=0.2)
    other = standin.fake_toolkit(rig.root, "12.4")
    rig.render()
    proc = subprocess.Popen(["sh", str(rig.script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=rig.env(), start_new_session=True)
    deadline = time.time() + 30
    while not (rig.prefix / "bin" / "ptxas").exists():
        assert time.time() < deadline, "the runfile never started writing"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)   # the whole install, script and runfile, dies midway
    proc.wait(timeout=10)
    assert (rig.prefix / IN_PROGRESS).exists() and (rig.prefix / "bin" / "nvcc").exists()
    assert not (rig.prefix / "include" / "cudnn_version.h").exists()
    assert rig.marker() is None
    # the kill left whatever the runfile did to the link; the record in the prefix has the truth
    assert "cuda_link=link:/usr/local/cuda-12.4" in (rig.prefix / IN_PROGRESS).read_text()
    res = rig.run()
    assert res.returncode == 0, res.stderr
    assert "interrupted install" in res.stdout
    assert rig.marker()["nvcc_version"] == "11.8.89"
    assert os.readlink(rig.link) == "/usr/local/cuda-12.4" and other.is_dir()
    assert not (rig.prefix / IN_PROGRESS).exists()


def test_adopt_mode_only_proves(rig):
    assert rig.run().returncode == 0
    os.remove(rig.want.marker)
    stamp = (rig.prefix / "lib64" / "libcudnn.so.8.9.7").stat().st_mtime_ns
    res = rig.run("adopt")
    assert res.returncode == 0, res.stderr
    assert rig.marker()["how"] == "adopt"
    assert (rig.prefix / "lib64" / "libcudnn.so.8.9.7").stat().st_mtime_ns == stamp


def test_adopt_refuses_a_wrong_cudnn(rig):
    assert rig.run().returncode == 0
    os.remove(rig.want.marker)
    header = rig.prefix / "include" / "cudnn_version.h"
    header.write_text(header.read_text().replace("CUDNN_MINOR 9", "CUDNN_MINOR 6"))
    res = rig.run("adopt")
    assert res.returncode != 0 and "says cuDNN 8.6.7, not 8.9.7" in res.stderr
    assert rig.marker() is None


def test_standin_runfile_refuses_unknown_flags_and_new_gcc_without_override(tmp_path):
    runfile = standin.build_runfile(tmp_path / "r.run", step_seconds=0)
    res = subprocess.run(["sh", str(runfile), "--silent", "--toolkit", "--samples"], capture_output=True, text=True)
    assert res.returncode == 1 and "Unknown option: --samples" in res.stdout
    gcc_dir = tmp_path / "bin"
    gcc_dir.mkdir()
    (gcc_dir / "gcc").write_text("#!/bin/sh\necho 12.2.0\n")
    (gcc_dir / "gcc").chmod(0o755)
    (tmp_path / "root" / "tmp").mkdir(parents=True)
    env = {**os.environ, "PATH": f"{gcc_dir}:{os.environ['PATH']}", "CUDA_STANDIN_ROOT": str(tmp_path / "root")}
    res = subprocess.run(["sh", str(runfile), "--silent", "--toolkit", f"--installpath={tmp_path}/p",
                          f"--tmpdir={tmp_path}"], capture_output=True, text=True, env=env)
    assert res.returncode == 1 and "Failed to verify gcc version" in res.stdout
