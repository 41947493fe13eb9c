"""The doctor: a failed run's logs matched against the rules of files/doctor/*.toml, and what to do (pure: text
in, findings out). deploy/doctor.py and deploy/status.py collect the logs from each box;
``python -m tasks.doctor`` (``__main__.py``) reads saved ones.

* ``diagnosis.py``: the rules, a box's verdict and findings (``diagnose``, ``render``, ``verdict``,
  ``never_ran``), an out-of-memory finding read against the box's plan, the command line (``main``);
* ``disk.py``: a full disk: which path filled, what was wanted and free, and for the checkpoint folder and the
  export the plan's numbers (``analyse_disk``, ``analyse_checkpoint_disk``).

Every public name of both is handed on here.
"""

from __future__ import annotations

from tasks.doctor.diagnosis import (
    ANALYSES,
    FAILED,
    FAILURE_MARKERS,
    FINE,
    NEAR_LINES,
    NEVER_RAN,
    NEVER_RAN_PREFLIGHT_FAILS,
    NEVER_RAN_PREFLIGHT_PASSES,
    NO_LOG,
    NO_RUN,
    NO_UNIT,
    NOT_ENDED,
    OFFLOAD_LADDER,
    OOM_ALLOC,
    OOM_PROCESS,
    OOM_TOTAL,
    PHASES,
    PLAN_KEYS,
    PREFLIGHT_FAIL,
    RULES_DIR,
    RULES_PATH,
    RUN_END,
    RUNNING,
    STOPPED,
    TAIL_LINES,
    VLLM_V0_KV,
    VLLM_V1_KV,
    Diagnosis,
    Finding,
    Rule,
    analyse_oom,
    analyse_vllm_kv,
    diagnose,
    load_rules,
    main,
    never_ran,
    read_plan,
    render,
    rule_files,
    verdict,
)
from tasks.doctor.disk import (
    CUT,
    ENV_GEN,
    HF_SPACE,
    OS_PATH,
    RAY_OBJECT,
    RAY_OVER,
    STAGE_SHORT,
    STAGING,
    analyse_checkpoint_disk,
    analyse_disk,
)

__all__ = [
    "CUT", "ENV_GEN", "HF_SPACE", "OS_PATH", "RAY_OBJECT", "RAY_OVER", "STAGE_SHORT", "STAGING",
    "analyse_checkpoint_disk", "analyse_disk", "ANALYSES", "FAILED", "FAILURE_MARKERS", "FINE", "NEAR_LINES",
    "NEVER_RAN", "NEVER_RAN_PREFLIGHT_FAILS", "NEVER_RAN_PREFLIGHT_PASSES", "NOT_ENDED", "NO_LOG", "NO_RUN", "NO_UNIT",
    "OFFLOAD_LADDER", "OOM_ALLOC", "OOM_PROCESS", "OOM_TOTAL", "PHASES", "PLAN_KEYS", "PREFLIGHT_FAIL", "RULES_DIR",
    "RULES_PATH", "RUNNING", "RUN_END", "STOPPED", "TAIL_LINES", "VLLM_V0_KV", "VLLM_V1_KV", "Diagnosis", "Finding",
    "Rule", "analyse_oom", "analyse_vllm_kv", "diagnose", "load_rules", "main", "never_ran", "read_plan", "render",
    "rule_files", "verdict",
]
