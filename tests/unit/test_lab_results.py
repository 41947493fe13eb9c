"""DeployResult parsing (tests/lab/results.py) on output shaped like pyinfra 3.10's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.lab.results import parse  # noqa: E402

TEXT_RUN = """\
--> Loading config...
--> Loading inventory...
--> Connecting to hosts...
    [\x1b[1mrtx3090\x1b[0m] \x1b[32mConnected\x1b[0m
    [t4]      Connected
    [p40]     Connected

--> Beginning operation run...
--> Starting operation: verl-lab base layout | Directory /opt/verl-lab/cache
    [t4]      \x1b[32mSuccess\x1b[0m
    [p40]     \x1b[36mNo changes\x1b[0m
    [rtx3090] No changes

--> Results:
    Operation                                                  Hosts   Success   Error   No Change
    verl-lab base layout | Directory /opt/verl-lab/cache       3       1         -       2
    Grand total                                                3       1         -       2

--> Disconnecting from hosts...
"""


def test_text_mode_counts_per_host_and_total():
    res = parse(["pyinfra"], 0, "", TEXT_RUN, ["p40", "t4", "rtx3090"], mode="text")
    assert res.changed == 1 and res.changed_by_host == {"p40": 0, "t4": 1, "rtx3090": 0}
    assert res.no_change_by_host == {"p40": 1, "t4": 0, "rtx3090": 1}
    assert res.ok and res.ran_operations


def test_json_mode():
    doc = {"plan": [], "results": {
        "operations": [{"name": "a", "success": ["p40"], "no_change": ["t4"], "error": []},
                       {"name": "b", "success": [], "no_change": [], "error": ["t4"]}],
        "totals": {"hosts": 4, "success": 1, "error": 1, "no_change": 1}, "failed_hosts": ["t4"]}}
    res = parse(["pyinfra"], 1, json.dumps(doc), "--> Beginning operation run...\n", ["p40", "t4"])
    assert res.changed == 1 and res.changed_by_host == {"p40": 1, "t4": 0}
    assert res.failed_hosts == ["t4"] and not res.ok
    assert res.changed_ops == [("p40", "a")]


def test_stopped_before_operations_counts_zero_changes():
    err = "--> Loading inventory...\n--> pyinfra error: verl-lab: the inventory has errors\n"
    res = parse(["pyinfra"], 1, "", err, ["p40"])
    assert res.changed == 0 and not res.ran_operations and not res.ok
