"""docs/plan.md's tables of plans are the code's: `python -m tasks.plan --doc-table` and
`--model-table`, each between its markers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.plan import doc_workload, gpu_table, model_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"


@pytest.mark.parametrize("marker, flag, make", [("doc-table", "--doc-table", gpu_table),
                                                ("model-table", "--model-table", model_table)])
def test_table_in_docs_is_made_from_the_code(marker, flag, make):
    text = DOC.read_text()
    begin, end = f"<!-- {marker}: begin -->\n", f"\n<!-- {marker}: end -->"
    assert begin in text and end in text
    documented = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert documented == make(doc_workload()), \
        f"docs/plan.md is stale: paste the output of `python -m tasks.plan {flag}` between its markers"
