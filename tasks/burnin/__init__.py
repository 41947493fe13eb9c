"""The burn-in (docs/burnin.md): before its long run, a box proves it trains, on its own plan, in a few minutes.

What the folder decides, one module a decision:

* ``plan.py``: what a box's burn-in runs (``burnin_plan``: the steps, the save and the resume, the reward, the
  learning rate and the test of "rises", each with its reason) and what it is measured against (the plan's memory
  per phase and the card; the speed model's seconds); ``burnin-plan.json`` beside plan.json;
* ``hearing.py``: what a burn-in record says against the plan (``hearing``: measured beside predicted, and what the
  box should change where they disagree), its line in the lab's status (``status_lines``) and the card's
  expected step time from earlier burn-ins (``expected_step_s``);
* ``plots.py``: its figure (reward and step seconds per step);
* ``stage.py``: the ``@deploy`` that runs it on the boxes (deploy/burnin.py); not imported here (no module below
  the stages imports a stage).

The box's side is verl_lab_box/burnin*.py (the launcher's ``--burnin``).
"""

from tasks.burnin.hearing import expected_step_s, hearing, hearing_words, status_lines
from tasks.burnin.plan import BURNIN_PLAN, BURNIN_UNIT, RECORD, BurninSpec, burnin_paths, burnin_plan

__all__ = ["BURNIN_PLAN", "BURNIN_UNIT", "RECORD", "BurninSpec", "burnin_paths", "burnin_plan", "expected_step_s",
           "hearing", "hearing_words", "status_lines"]
