"""The env's pip: a venv's bundled pip may be too old for the Apex build's --config-settings
(Ubuntu 22.04's `python3 -m venv` brings pip 22.0.2), so the build script brings it to the pin
in files/requirements/build-tools.txt first. Run against a real venv holding pip 22.0.2.

The pip wheels come from PyPI once into the test cache (tests/fixtures/standins/env.py,
``pip_wheel``); the build script then installs from a PEP 503 index of them on disk.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

import tasks.env as envstage
from tests.fixtures.standins import env as standin
from tests.unit.test_env import BUILD, gpus, settings

OLD_PIP = "22.0.2"          # Ubuntu 22.04's python3-pip-whl, what its `python3 -m venv` installs
SECTION = re.compile(r"^# pip \(begin\).*?^# pip \(end\)$", re.S | re.M)
# A project whose in-tree build backend records the config settings pip hands it.
BACKEND = '''
import json, os

def _record(config_settings):
    with open(os.environ["VERL_LAB_CONFIG_SETTINGS"], "w") as fh:
        json.dump(config_settings, fh)

def get_requires_for_build_wheel(config_settings=None):
    return []

def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _record(config_settings)
    info = os.path.join(metadata_directory, "tiny-1.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write("Metadata-Version: 2.1\\nName: tiny\\nVersion: 1.0\\n")
    return "tiny-1.0.dist-info"

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("a dry run builds no wheel")
'''
PYPROJECT = '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'


def clean_env(**extra) -> dict:
    """This machine's pip settings (find-links, extra indexes) left out, as on a box."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def old_pip_venv(dest: Path) -> Path:
    """A venv of this Python holding pip 22.0.2 (installed by that pip's own wheel); its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    wheel = standin.pip_wheel(OLD_PIP)
    python = dest / "bin" / "python"
    subprocess.run([str(python), f"{wheel}/pip", "install", "-q", "--no-index", str(wheel)],
                   check=True, env=clean_env(), timeout=120)
    return python


def pip_version(python: Path) -> str:
    return subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True,
                          check=True, env=clean_env(), timeout=60).stdout.split()[1]


def tiny_project(dest: Path) -> Path:
    dest.mkdir()
    (dest / "pyproject.toml").write_text(PYPROJECT)
    (dest / "backend.py").write_text(BACKEND)
    return dest


def config_settings_call(python: Path, project: Path, record: Path) -> subprocess.CompletedProcess:
    """What the Apex build asks of pip: two --config-settings of one key, no build isolation."""
    return subprocess.run(
        [str(python), "-m", "pip", "install",
         "--config-settings", "--build-option=--cpp_ext", "--config-settings", "--build-option=--cuda_ext",
         "--dry-run", "--no-deps", "--no-index", "--no-build-isolation", str(project)],
        capture_output=True, text=True, env=clean_env(VERL_LAB_CONFIG_SETTINGS=str(record)), timeout=120)


def build_tools_pip() -> str:
    lines = envstage.requirement_lines(envstage.BUILD_TOOLS)
    pins = [line.partition("==")[2] for line in lines if line.partition("==")[0].strip().lower() == "pip"]
    assert pins, f"{envstage.BUILD_TOOLS} pins no pip==<version>"
    return pins[0]


def pip_section(tmp: Path, pypi: Path) -> tuple[str, Path]:
    """The part of a rendered venv build script that prepares pip, and the constraints file it reads
    (placed where the stage places it)."""
    s = settings(env_backend="venv", lab_root=str(tmp / "lab"), env_prefix=str(tmp / "lab" / "envs" / "verl"),
                 mirror_urls={"pypi": pypi.as_uri(), "pytorch": (tmp / "no-torch-index").as_uri()})
    plan = envstage.plan_env(s, gpus(), BUILD)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(envstage.TEMPLATES)), keep_trailing_newline=True)
    script = env.get_template("env-build.sh.j2").render(**envstage.build_script_context(s, plan, None))
    found = SECTION.search(script)
    assert found, "the build script has no '# pip (begin)' ... '# pip (end)' part"
    constraints = Path(envstage.build_dir(s)) / "constraints.txt"
    constraints.parent.mkdir(parents=True)
    constraints.write_text(env.get_template("env-constraints.txt.j2").render(lines=list(plan.constraints)))
    return found.group(0), constraints


def run_section(section: str, python: Path) -> subprocess.CompletedProcess:
    gen = python.parent.parent
    script = f'set -euo pipefail\nGEN={gen}\nPY="$GEN/bin/python"\n{section}\n'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=clean_env(), timeout=300)


@pytest.fixture
def old_venv(tmp_path):
    python = old_pip_venv(tmp_path / "env.gen1")
    assert pip_version(python) == OLD_PIP
    return python


def test_pip_22_0_2_refuses_config_settings(old_venv, tmp_path):
    res = config_settings_call(old_venv, tiny_project(tmp_path / "tiny"), tmp_path / "settings.json")
    assert res.returncode != 0
    assert "no such option: --config-settings" in res.stderr


def test_build_script_brings_pip_to_its_pin_before_the_apex_build(old_venv, tmp_path):
    pin = build_tools_pip()
    index = tmp_path / "pypi" / "simple"
    standin.simple_index(index, [standin.pip_wheel(pin)])
    section, _ = pip_section(tmp_path, index)
    res = run_section(section, old_venv)
    assert res.returncode == 0, res.stderr
    assert pip_version(old_venv) == pin
    record = tmp_path / "settings.json"
    res = config_settings_call(old_venv, tiny_project(tmp_path / "tiny"), record)
    assert res.returncode == 0, res.stderr
    # both values of the one key reach the backend (pip < 23.1 kept only the last)
    assert json.loads(record.read_text()) == {"--build-option": ["--cpp_ext", "--cuda_ext"]}


def test_pip_that_cannot_be_brought_up_fails_the_build_naming_its_version(old_venv, tmp_path):
    pin = build_tools_pip()
    index = tmp_path / "pypi" / "simple"
    standin.simple_index(index, [standin.pip_wheel(OLD_PIP)])     # the mirror lacks the pin
    section, _ = pip_section(tmp_path, index)
    res = run_section(section, old_venv)
    assert res.returncode != 0
    assert f"its pip: {OLD_PIP}" in res.stderr and f"pip=={pin}" in res.stderr and ">= 23.1" in res.stderr
    assert pip_version(old_venv) == OLD_PIP


def test_build_tools_pin_a_pip_with_repeatable_config_settings():
    assert tuple(int(x) for x in build_tools_pip().split(".")[:2]) >= (23, 1)
    plan = envstage.plan_env(settings(), gpus(), BUILD)
    assert f"pip=={build_tools_pip()}" in plan.constraints
