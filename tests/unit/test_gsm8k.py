"""The project's GSM8K preprocessing, on rows shaped like GSM8K's."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.fixtures.standins.hf_endpoint import gsm8k_rows, parquet_bytes
from verl_lab_box import gsm8k

INSTR = "Let's think step by step and output the final answer after \"####\"."


@pytest.mark.parametrize("answer, truth", [
    ("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
    ("Total is 1,200 + 34 = <<1200+34=1234>>1,234.\n#### 1,234", "1234"),
    ("He pays $12 * 100 = $<<12*100=1200>>1200.\n#### $1,200", "1200"),
    ("Loss of 5.\n#### -5", "-5"),
    ("Half of 7 is 3.5\n#### 3.5", "3.5"),
    ("Answer with spaces\n####   42  ", "42"),
    ("Answer with a period\n#### 42.", "42"),
    # two '####': the last one is the final answer (documented policy)
    ("First try #### 10 was wrong, so\n#### 12", "12"),
    ("#### 1,000,000", "1000000"),
])
def test_final_answer(answer, truth):
    assert gsm8k.final_answer(answer) == truth


@pytest.mark.parametrize("answer, why", [
    ("No final line here, just 12 apples.", "no '####'"),
    ("#### twelve", "not a number"),
    ("#### ", "not a number"),
    ("#### 3/4", "not a number"),
])
def test_final_answer_rejects(answer, why):
    with pytest.raises(gsm8k.Gsm8kError, match=why):
        gsm8k.final_answer(answer)


def test_row_is_exactly_verls_shape():
    row = gsm8k.to_verl_row("Tom has 2 cats. How many?", "2 cats.\n#### 2", "train", 5)
    assert list(row) == list(gsm8k.VERL_COLUMNS)
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Tom has 2 cats. How many? " + INSTR}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 5, "answer": "2 cats.\n#### 2",
                       "question": "Tom has 2 cats. How many?"},
    }


def test_missing_hashes_is_an_error_naming_the_row_or_skipped():
    rows = [{"question": "q1", "answer": "a\n#### 1"}, {"question": "q2", "answer": "no final answer"},
            {"question": "q3", "answer": "c\n#### 3"}]
    with pytest.raises(gsm8k.Gsm8kError, match=r"test row 1: the answer has no '####'"):
        gsm8k.convert(rows, "test")
    out, skipped = gsm8k.convert(rows, "test", bad_rows="skip")
    assert skipped == 1
    assert [r["reward_model"]["ground_truth"] for r in out] == ["1", "3"]
    assert [r["extra_info"]["index"] for r in out] == [0, 2]  # indices stay those of the source rows


def _inputs(tmp_path, train_rows=None, test_rows=None):
    train, test = gsm8k_rows()
    t = tmp_path / "train.src.parquet"
    s = tmp_path / "test.src.parquet"
    t.write_bytes(parquet_bytes(train_rows if train_rows is not None else train))
    s.write_bytes(parquet_bytes(test_rows if test_rows is not None else test))
    return t, s


def test_build_prove_and_idempotent_rerun(tmp_path):
    train, test = _inputs(tmp_path)
    out = tmp_path / "out"
    first = gsm8k.build(train, test, out, val_rows=5)
    assert first["changed"] is True
    assert {n: o["rows"] for n, o in first["outputs"].items()} == \
        {"train.parquet": 40, "test.parquet": 12, "val_small.parquet": 5}
    table = pq.read_table(out / "train.parquet")
    assert table.column_names == list(gsm8k.VERL_COLUMNS)
    rows = table.to_pylist()
    assert any("," in r["extra_info"]["answer"].rsplit("####", 1)[1] for r in rows), "fixture lacks commas"
    assert all("," not in r["reward_model"]["ground_truth"] for r in rows)
    val = pq.read_table(out / "val_small.parquet").to_pylist()
    assert val == pq.read_table(out / "test.parquet").to_pylist()[:5]
    assert gsm8k.prove(out, {"train": 40, "test": 12, "val_small": 5}) == {"train": 40, "test": 12, "val_small": 5}

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    second = gsm8k.build(train, test, out, val_rows=5)
    assert second["changed"] is False
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes

    # a changed input is noticed through its sha256 and rebuilt
    rows_in = gsm8k_rows()[0][:30]
    train.write_bytes(parquet_bytes(rows_in))
    third = gsm8k.build(train, test, out, val_rows=5)
    assert third["changed"] is True and third["outputs"]["train.parquet"]["rows"] == 30

    # a damaged output is rebuilt too
    (out / "test.parquet").write_bytes(b"garbage")
    assert gsm8k.build(train, test, out, val_rows=5)["changed"] is True
    assert gsm8k.prove(out, {"train": 30, "test": 12})["test"] == 12


def test_prove_catches_wrong_counts_and_bad_truths(tmp_path):
    train, test = _inputs(tmp_path)
    out = tmp_path / "out"
    gsm8k.build(train, test, out)
    with pytest.raises(gsm8k.Gsm8kError, match="40 rows, expected 7473"):
        gsm8k.prove(out, {"train": 7473})
    import pyarrow as pa
    rows = pq.read_table(out / "test.parquet").to_pylist()
    rows[3]["reward_model"]["ground_truth"] = "1,000"
    pq.write_table(pa.Table.from_pylist(rows, schema=gsm8k.verl_schema()), out / "test.parquet")
    with pytest.raises(gsm8k.Gsm8kError, match=r"row 3: ground_truth '1,000' is not a number"):
        gsm8k.prove(out, {})


def test_build_refuses_bad_rows_and_wrong_columns(tmp_path):
    bad_test = gsm8k_rows()[1] + [{"question": "How many?", "answer": "I forgot the final line."}]
    train, test = _inputs(tmp_path, test_rows=bad_test)
    with pytest.raises(gsm8k.Gsm8kError, match=r"test row 12: the answer has no '####'"):
        gsm8k.build(train, test, tmp_path / "out")
    assert not (tmp_path / "out" / gsm8k.RECORD).exists()
    import pyarrow as pa
    pq.write_table(pa.table({"problem": ["x"], "solution": ["#### 1"]}), test)
    with pytest.raises(gsm8k.Gsm8kError, match="no column answer, question"):
        gsm8k.build(train, test, tmp_path / "out")


def test_cli_as_pushed_to_a_box(tmp_path):
    train, test = _inputs(tmp_path)
    out = tmp_path / "out"
    script = gsm8k.__file__
    run = [sys.executable, script, "build", "--train", str(train), "--test", str(test), "--out", str(out)]
    first = subprocess.run(run, capture_output=True, text=True, check=True)
    assert first.stdout.startswith("wrote ")
    assert json.loads(first.stdout.split(" ", 1)[1]) == {"test.parquet": 12, "train.parquet": 40,
                                                        "val_small.parquet": 12}
    assert subprocess.run(run, capture_output=True, text=True, check=True).stdout.startswith("unchanged ")
    ok = subprocess.run([sys.executable, script, "prove", "--out", str(out), "--train-rows", "40",
                         "--test-rows", "12", "--val-rows", "12"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, script, "prove", "--out", str(out), "--train-rows", "7473"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "expected 7473" in bad.stderr
