"""docs/plan.md's table of plans is the code's: `python -m tasks.plan --doc-table` between its markers."""

from __future__ import annotations

from pathlib import Path

from tasks.plan import doc_workload, gpu_table, model_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"


def test_plan_table_in_docs_is_made_from_the_code():
    text = DOC.read_text()
    begin, end = "<!-- doc-table: begin -->\n", "\n<!-- doc-table: end -->"
    assert begin in text and end in text
    documented = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert documented == gpu_table(doc_workload()), \
        "docs/plan.md is stale: paste the output of `python -m tasks.plan --doc-table` between its markers"


def test_model_table_in_docs_is_made_from_the_code():
    text = DOC.read_text()
    begin, end = "<!-- model-table: begin -->\n", "\n<!-- model-table: end -->"
    assert begin in text and end in text
    documented = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert documented == model_table(doc_workload()), \
        "docs/plan.md is stale: paste the output of `python -m tasks.plan --model-table` between its markers"
