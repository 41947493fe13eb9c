"""Facts that cannot change during one deploy, asked once per host per run.

pyinfra asks a fact again every time a stage calls ``host.get_fact``. Some answers cannot change
while verl-lab runs (the box's GPUs: no stage touches them), yet two stages need them (the env
stage for vLLM and the Apex arch list, the training stage for the plan). ``once`` keeps the
first answer for the host object of this run; a new run (a new pyinfra process or State) asks
again.
"""

from __future__ import annotations

import json

_ANSWERS: dict[tuple, tuple] = {}


def once(fact, **kwargs):
    """``host.get_fact(fact, **kwargs)``, asked once per host of this run."""
    from pyinfra import host

    real = host._get_module()          # the Host behind pyinfra's context proxy
    key = (id(real), fact.__module__, fact.__name__, json.dumps(kwargs, sort_keys=True, default=str))
    held = _ANSWERS.get(key)
    if held is None or held[0] is not real:     # an id reused by a later Host object: ask again
        held = (real, host.get_fact(fact, **kwargs))
        _ANSWERS[key] = held
    return held[1]
