"""tasks/facts/bundle.py: several facts in one command give what each gives alone."""

from __future__ import annotations

import subprocess

import pytest
from pyinfra.api import FactBase, StringCommand
from pyinfra.facts.server import LinuxDistribution

from tasks.facts.bundle import Bundle, _text
from tasks.facts.data import FilesPresent
from tasks.facts.env import VerlCheckout
from tasks.facts.files import Marker, PathStates
from tasks.facts.gpu import NvidiaGpus
from tasks.facts.nvidia import CudaHostCompiler


class Failing(FactBase):
    def command(self):
        return "echo partial; exit 3"

    def process(self, output):
        return list(output)


class Silent(FactBase):
    @staticmethod
    def default():
        return {"default": True}

    def command(self):
        return "true"

    def process(self, output):
        return {"lines": list(output)}


class Quoted(FactBase):
    def command(self):
        return StringCommand("echo", "'a b'")

    def process(self, output):
        return list(output)


def sh(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)


def alone(cls, kwargs):
    """What host.get_fact would give for the fact alone (its command here, pyinfra's rules)."""
    out = sh(_text(cls().command(**kwargs)))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    return cls().process(lines) if lines else cls().default()


def test_each_answer_is_what_the_fact_gives_alone(tmp_path):
    marker = tmp_path / "envstage.done"
    marker.write_text("stamp=abc\ngeneration=/x.gen1\n")
    (tmp_path / "f").write_text("x")
    facts = [
        (Marker, {"path": str(marker)}),
        (Marker, {"path": str(tmp_path / "none.done")}),
        (PathStates, {"paths": [str(tmp_path), str(tmp_path / "f"), str(tmp_path / "missing")]}),
        (FilesPresent, {"paths": [str(tmp_path / "f")]}),
        (VerlCheckout, {"path": str(tmp_path / "no-clone"), "ref": "v0.5.0", "patches": []}),   # exits 0 early
        (LinuxDistribution, {}),
        (NvidiaGpus, {}),
        (CudaHostCompiler, {}),
        (Silent, {}),
        (Quoted, {}),
    ]
    out = sh(Bundle().command(facts=facts))
    assert out.returncode == 0, out.stderr
    got = Bundle().process(out.stdout.splitlines())
    assert len(got) == len(facts)
    for (cls, kwargs), answer in zip(facts, got, strict=True):
        assert answer == alone(cls, kwargs), cls.__name__
    assert got[0] == {"stamp": "abc", "generation": "/x.gen1"} and got[1] is None
    assert got[8] == {"default": True}            # no output: the fact's default
    assert got[9] == ["a b"]


def test_a_failing_fact_fails_the_bundle_after_every_section_ran(tmp_path):
    facts = [(Failing, {}), (Marker, {"path": str(tmp_path / "m")})]
    out = sh(Bundle().command(facts=facts))
    assert out.returncode == 3
    got = Bundle().process(out.stdout.splitlines())
    assert got == [["partial"], None]


def test_facts_with_requires_command_are_refused():
    class NeedsTool(FactBase):
        def requires_command(self):
            return "some-tool"

        def command(self):
            return "some-tool --version"

    with pytest.raises(ValueError, match="requires_command"):
        Bundle().command(facts=[(NeedsTool, {})])
