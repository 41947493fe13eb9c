"""The model and the dataset a box trains on, mirrored through a Hugging Face endpoint, and GSM8K in verl's
format.

* ``plan.py``: the data stage's plan (pure: ``data_plan``, ``DataPlan``): which snapshots a host gets, from
  where, into which folders, and the rows its GSM8K splits must have; the inventory check
  (tasks/validation.py) makes it for every host before any host changes;
* ``stage.py``: the ``@deploy`` that carries it out (``install_data``; deploy/data.py, deploy/full.py),
  imported by its path, never here: no module below the stages imports a stage, and this ``__init__`` runs
  whenever any module of the folder is imported.

The box's side is verl_lab_box/hf_snapshot.py and gsm8k.py. Every public name of ``plan`` is handed on here.
"""

from __future__ import annotations

from tasks.data.plan import SCRIPTS, DataPlan, data_plan

__all__ = [
    "SCRIPTS", "DataPlan", "data_plan",
]
