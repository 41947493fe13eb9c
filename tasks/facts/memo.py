"""Facts that cannot change during one deploy, asked once per host per run.

pyinfra asks a fact again every time a stage calls ``host.get_fact``. Some answers cannot change
while verl-lab runs (the box's GPUs: no stage touches them), yet two stages need them (the env
stage for vLLM and the Apex arch list, the training stage for the plan). ``remember`` keeps an
answer for the host object of this run and ``known`` gives it back; a new run (a new pyinfra
process or State) asks again.
"""

from __future__ import annotations

import json

_ANSWERS: dict[tuple, tuple] = {}


def _key(real, fact, kwargs) -> tuple:
    return (id(real), fact.__module__, fact.__name__, json.dumps(kwargs, sort_keys=True, default=str))


def _real_host():
    from pyinfra import host

    return host._get_module()          # the Host behind pyinfra's context proxy


def known(fact, **kwargs) -> tuple[bool, object]:
    """(True, answer) when this run already asked ``fact`` of the current host, else (False, None)."""
    real = _real_host()
    held = _ANSWERS.get(_key(real, fact, kwargs))
    if held is None or held[0] is not real:     # an id reused by a later Host object
        return False, None
    return True, held[1]


def remember(fact, answer, **kwargs):
    """Keep an answer (got in a tasks.facts.bundle.Bundle) for ``known``."""
    real = _real_host()
    _ANSWERS[_key(real, fact, kwargs)] = (real, answer)
    return answer
