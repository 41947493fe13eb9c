"""Which keys of a host's data verl-lab reads, and what it says of every other one.

pyinfra hands a deploy every key of a host's data (the inventory, ``group_data/*.py``, ``--data``) and ignores
those nothing asks for, so a key verl-lab does not read would leave its default in place without a word. Every
key is therefore one of:

* a verl-lab setting (``tasks.settings.DEFAULTS``);
* a **dotted key** into a nested setting (``workload.model``, ``checkpoints.keep``, ``tracking.mode``,
  ``catalog_overrides.qwen_model.revision``): it sets that one key inside the setting, over what the setting's
  mapping gives, wherever each is set (``--data workload.model=...`` over ``workload = {...}`` in group_data);
* pyinfra's own (its connectors' ``ssh_*``/``docker_*``... keys, its global arguments ``_sudo``...);
* another deploy's (``DEPLOY_KEYS``: ``--data status_json=...`` for deploy/status.py);
* the site's own: a name starting with ``site_`` (``SITE_PREFIX``), which verl-lab never reads;

and anything else is refused before any host changes, naming the nested key a top-level key names
(``model`` -> ``workload.model``) or the setting it is a near miss of.

Pure; imports nothing of the project. ``tasks.settings.load_settings`` runs ``expand_dotted`` and
``unread_keys``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from tasks.settings.errors import SettingsError

# Host data that belongs to pyinfra: its connectors' keys and its global arguments (``_sudo``...)
PYINFRA_KEY_PREFIXES = ("_", "ssh_", "docker_", "podman_", "chroot_", "local_", "winrm_", "vagrant_",
                        "terraform_", "fake_")
# pyinfra's one global argument without "_": host data ``name`` is every operation's default name
# (pyinfra.api.arguments.pop_global_arguments reads each global argument from host data)
PYINFRA_KEYS = ("name",)
# Host data the other deploy files read (``host.data.get``; tests/unit/test_settings_keys.py finds every one)
DEPLOY_KEYS = {"status_json": "deploy/status.py", "status_plots": "deploy/status.py",
               "doctor_json": "deploy/doctor.py"}
# A site's own keys (notes, its own deploys' values): verl-lab never reads them and never refuses them
SITE_PREFIX = "site_"
NEAR_MISS_CUTOFF = 0.8
DOTTED_EXAMPLE = "--data workload.model=Qwen/Qwen2.5-1.5B-Instruct"


def nested_keys(defaults: Mapping[str, Any], inner: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """The nested settings (those whose value is a mapping) and the keys each knows: ``inner`` gives a
    setting's keys where its default is empty (workload's, checkpoints', tracking's, the cluster's...)."""
    found = {key: tuple(value) for key, value in defaults.items() if isinstance(value, Mapping)}
    found.update({key: tuple(keys) for key, keys in inner.items()})
    return found


def expand_dotted(host: str, data: Mapping[str, Any], nested: Mapping[str, tuple[str, ...]]
                  ) -> tuple[dict[str, Any], list[SettingsError]]:
    """``data`` with every dotted key (``workload.model``) set inside its nested setting, and the problems of
    the dotted keys that name no nested setting (those are left out). Dotted keys are applied shortest first,
    each over the mapping the setting had, so ``workload.model`` wins over ``workload = {"model": ...}``."""
    out = {k: v for k, v in data.items() if "." not in k}
    problems = []
    for key in sorted((k for k in data if "." in k), key=lambda k: (k.count("."), k)):
        if key.startswith(PYINFRA_KEY_PREFIXES + (SITE_PREFIX,)):
            out[key] = data[key]
            continue
        head, *path = key.split(".")
        if head not in nested:
            close = difflib.get_close_matches(head, sorted(nested), n=1, cutoff=0.6)
            problems.append(SettingsError(host, key, f"{head!r} is not a nested setting (it would be ignored)",
                                     (f"did you mean {close[0]}.{'.'.join(path)}? " if close else "")
                                     + f"a dotted key sets a key inside one of {', '.join(sorted(nested))}, "
                                     f"e.g. {DOTTED_EXAMPLE}"))
            continue
        if not all(path):
            problems.append(SettingsError(host, key, "a dotted key with an empty part",
                                     f"name one key inside {head}, e.g. {DOTTED_EXAMPLE}"))
            continue
        top = out.get(head)
        if top is not None and not isinstance(top, Mapping):
            problems.append(SettingsError(host, key, f"{head} is {top!r}, not a mapping to set {'.'.join(path)} in",
                                     f"set {head} to a mapping, or leave it out and use the dotted key alone"))
            continue
        value = dict(top or {})
        out[head] = node = value
        for part in path[:-1]:
            inner = node.get(part)
            if inner is not None and not isinstance(inner, Mapping):
                problems.append(SettingsError(host, key, f"{head}.{part} is {inner!r}, not a mapping",
                                         f"set {head}.{part} to a mapping first"))
                break
            node[part] = node = dict(inner or {})
        else:
            node[path[-1]] = data[key]
    return out, problems


def _meant(key: str, known: set[str], nested: Mapping[str, tuple[str, ...]]) -> list[str]:
    """What a key no setting has may have meant: the nested keys it names, else the setting it is a near
    miss of, else the nested key it is a near miss of."""
    inside = [f"{head}.{key}" for head, keys in sorted(nested.items()) if key in keys]
    if inside:
        return inside
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=NEAR_MISS_CUTOFF)
    if close:
        return close
    leaves = [(k, head) for head, keys in sorted(nested.items()) for k in keys]
    close = difflib.get_close_matches(key, sorted({k for k, _ in leaves}), n=2, cutoff=NEAR_MISS_CUTOFF)
    return [f"{head}.{k}" for c in close for k, head in leaves if k == c]


def is_read_elsewhere(key: str) -> bool:
    """pyinfra's own key, another deploy's, or the site's: not verl-lab's to refuse."""
    return key.startswith(PYINFRA_KEY_PREFIXES + (SITE_PREFIX,)) or key in PYINFRA_KEYS or key in DEPLOY_KEYS


def unread_keys(host: str, data: Mapping[str, Any], known: set[str], nested: Mapping[str, tuple[str, ...]]
                ) -> list[SettingsError]:
    """A problem for every top-level key of ``data`` (dotted keys already expanded) that nothing reads."""
    found = []
    for key in data:
        if key in known or is_read_elsewhere(key):
            continue
        meant = _meant(key, known, nested)
        if meant and "." in meant[0]:
            value = data[key]
            head, leaf = meant[0].split(".", 1)
            found.append(SettingsError(host, key, f"a key of {' and of '.join(m.split('.')[0] for m in meant)}, not a "
                                       "setting of its own (it would be ignored and the default used)",
                                       f"did you mean {' or '.join(meant)}? --data {meant[0]}={value}, or {head} = "
                                       f"{{{leaf!r}: {value!r}}} in host data or group_data"))
        elif meant:
            found.append(SettingsError(host, key, "not a verl-lab setting (it would be ignored and the default used)",
                                  f"did you mean {meant[0]}? (every setting and its default: tasks/settings/load.py "
                                  "DEFAULTS)"))
        else:
            found.append(SettingsError(host, key, "not a verl-lab setting, nor pyinfra's (ssh_*, _sudo...), nor a deploy's "
                                  f"({', '.join(sorted(DEPLOY_KEYS))}): nothing would read it",
                                  f"remove it, or name your site's own keys {SITE_PREFIX}* (README, Settings); every "
                                  "setting and its default: tasks/settings/load.py DEFAULTS"))
    return found
