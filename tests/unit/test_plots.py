"""Progress plots (tasks/plots.py) from a real verl 0.5.0 log captured on the GPU
(tests/fixtures/verl_logs/p40-plan-h200.log: the P40 plan, 5 steps and validation, on the H200)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tasks import plots
from tasks.status import read_log

LOG = Path(__file__).resolve().parents[1] / "fixtures" / "verl_logs" / "p40-plan-h200.log"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_series_are_the_logs_values():
    data = plots.series(read_log(LOG))
    assert [n for n, _ in data["score"]] == [1, 2, 3, 4, 5]
    assert [n for n, _ in data["validation"]] == [5]            # verl validated after the last step
    steps = {s["step"]: s["metrics"] for s in read_log(LOG).steps}
    assert dict(data["response_length"]) == {n: m["response_length/mean"] for n, m in steps.items()}
    # seconds per step less the validation verl counts inside the last step
    assert dict(data["seconds_per_step"])[5] == pytest.approx(
        steps[5]["timing_s/step"] - steps[5]["timing_s/testing"])
    assert dict(data["seconds_per_step"])[2] == steps[2]["timing_s/step"]


def test_a_png_per_box_and_a_lab_figure(tmp_path):
    cut = tmp_path / "cut.log"
    text = LOG.read_text()
    cut.write_text(text[: text.index("step:3 -")])                 # a run still going (2 steps)
    empty = tmp_path / "empty.log"
    empty.write_text("nothing from verl yet\n")
    out = tmp_path / "plots"
    assert plots.main(["--out", str(out), f"p40={LOG}", f"t4={cut}", f"new={empty}"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["lab.png", "p40.png", "t4.png"]
    width, height = _png_size(out / "p40.png")
    assert width > height > 200
    assert _png_size(out / "lab.png")[0] > 600


def test_nothing_to_plot_says_so(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing from verl yet\n")
    assert plots.main(["--out", str(tmp_path / "o"), str(empty)]) == 2
    assert "no verl step lines yet" in capsys.readouterr().err
    assert plots.main(["--out", str(tmp_path / "o"), str(tmp_path / "missing.log")]) == 2


def test_gsm8k_base_against_trained_per_box(tmp_path):
    """The GSM8K figure comes with deploy/status.py's scores (its JSON for the CLI), only where a
    box has one."""
    import json

    status_json = tmp_path / "lab.json"
    status_json.write_text(json.dumps({"hosts": [
        {"host": "p40", "gsm8k": {"base": 0.312, "trained": 0.355, "step": 20, "final": True}},
        {"host": "t4", "gsm8k": {"base": 0.312, "trained": None, "step": None, "final": None}},
        {"host": "new", "gsm8k": {"base": None, "trained": None, "step": None, "final": None}}]}))
    out = tmp_path / "plots"
    assert plots.main(["--out", str(out), "--status-json", str(status_json), f"p40={LOG}"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gsm8k.png", "p40.png"]
    assert _png_size(out / "gsm8k.png")[0] > 300
    none = tmp_path / "none"
    plots.plot_all({"p40": read_log(LOG)}, none, {"new": {"base": None, "trained": None}})
    assert sorted(p.name for p in none.iterdir()) == ["p40.png"]
