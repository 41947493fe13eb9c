"""The folders and files a stage writes, decided from one fact.

pyinfra's ``files.directory`` / ``files.put`` / ``files.template`` ask 1-3 facts per path on
every run (the parent folder, the file, its sha1). A stage lists what it wants instead
(``Wanted``: a folder, or a file with its exact bytes, rendered here), asks one
``PathStates`` fact for all of them, and calls pyinfra's operations only for the paths that
differ (missing, other bytes, other mode/owner, a link or a folder where a file belongs). A
re-run on a box as it should be costs one command per stage and changes nothing; drift on the
box (an edited file, a chmod) is still put right.

The first part is pure (``wanted_file``, ``differs``), unit-tested without pyinfra.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from pyinfra.api import FileUploadCommand, StringCommand, operation


@dataclass(frozen=True)
class Wanted:
    """A folder (``content`` None) or a file with its bytes, mode and owner; ``secret``: bytes pyinfra must
    never print (placed by ``secret_file``, not ``files.put``, whose ``--diff`` prints them)."""

    path: str
    name: str
    mode: str = "644"
    user: str = "root"
    group: str = "root"
    content: bytes | None = None
    secret: bool = False

    @property
    def is_dir(self) -> bool:
        return self.content is None

    @property
    def sha1(self) -> str | None:
        return None if self.content is None else hashlib.sha1(self.content).hexdigest()


def wanted_dir(path: str, name: str | None = None, mode: str = "755", user: str = "root",
               group: str = "root") -> Wanted:
    return Wanted(path=path, name=name or f"Directory {path}", mode=mode, user=user, group=group)


def wanted_file(path: str, name: str, content: bytes | str, mode: str = "644", user: str = "root",
                group: str = "root", secret: bool = False) -> Wanted:
    data = content.encode() if isinstance(content, str) else bytes(content)
    return Wanted(path=path, name=name, mode=mode, user=user, group=group, content=data, secret=secret)


def rendered(template: Path, **values) -> str:
    """A template rendered exactly as pyinfra's files.template renders it (its jinja2 settings)."""
    from pyinfra.api.util import get_template

    return get_template(str(template)).render(values)


def _same_mode(have: str, want: str) -> bool:
    try:
        return int(have, 8) == int(want, 8)
    except ValueError:
        return False


def differs(state: dict | None, want: Wanted) -> str | None:
    """Why the box's ``state`` (a PathStates entry) is not ``want``; None when it is."""
    if state is None:
        return "missing"
    kind = "dir" if want.is_dir else "file"
    if state.get("kind") != kind:
        return f"a {state.get('kind')} where a {kind} belongs"
    if not want.is_dir and state.get("sha1") != want.sha1:
        return "other content"
    if not _same_mode(state.get("mode", ""), want.mode):
        return f"mode {state.get('mode')} != {want.mode}"
    if (state.get("user"), state.get("group")) != (want.user, want.group):
        return f"owner {state.get('user')}:{state.get('group')} != {want.user}:{want.group}"
    return None


# ------------------------------------------------------------------ the pyinfra part


def place(wanted: list[Wanted], states: dict | None = None) -> dict[str, str | None]:
    """Queue pyinfra operations for every wanted path that differs; ``{path: why | None}``.

    Call it from a ``@deploy`` body: the fact is read when the operations are prepared, and
    the operations queued are pyinfra's own (their facts are read when they run), in the order
    given, so a folder listed before its files exists before they are written. ``states``: a
    PathStates answer the caller already has (covering every wanted path), to save the command.
    """
    from pyinfra import host
    from pyinfra.operations import files

    from tasks.facts.files import PathStates

    states = dict(states or {})
    unknown = [w.path for w in wanted if w.path not in states]
    if unknown:       # not in the answer the caller had (or none given): ask for those
        states.update(host.get_fact(PathStates, paths=unknown) or {})
    result = {}
    for want in wanted:
        why = differs(states.get(want.path), want)
        result[want.path] = why
        if why is None:
            continue
        state = states.get(want.path)
        if state is not None and state.get("kind") == "link":
            # pyinfra's put would write through the link: remove the link itself first
            files.link(name=f"{want.name}: remove the link in its place", path=want.path, present=False)
        if want.is_dir:
            files.directory(name=want.name, path=want.path, mode=want.mode, user=want.user, group=want.group)
        elif want.secret:
            secret_file(name=want.name, src=BytesIO(want.content), dest=want.path, mode=want.mode, user=want.user,
                        group=want.group)
        else:
            files.put(name=want.name, src=BytesIO(want.content), dest=want.path, mode=want.mode,
                      user=want.user, group=want.group)
    return result


@operation()
def secret_file(src, dest: str, mode: str, user: str, group: str):
    """A file whose bytes pyinfra never prints: ``files.put`` prints a file's new (and old) lines with
    ``--diff``; this operation prints nothing of them. The bytes go by SFTP (never in a command's argv)
    into ``<dest>.part``, made empty, root's and 0600 before they arrive (the upload keeps an existing
    file's mode), which then gets its owner and mode and is renamed over ``dest``. ``dest``'s folder must be
    root's alone to write (it is: the stages' folders are)."""
    from pyinfra import host

    q = shlex.quote
    part = f"{dest}.part"
    yield StringCommand(f"rm -f {q(part)} && (umask 077 && : > {q(part)})")
    yield FileUploadCommand(src, part, remote_temp_filename=host.get_temp_filename(part))
    yield StringCommand(f"chown {q(user)}:{q(group)} {q(part)} && chmod {q(mode)} {q(part)} && "
                        f"mv -f {q(part)} {q(dest)}")


# ------------------------------------------------------------------ stage markers


class OnBox(str):
    """A marker value the box works out when the marker is written (a shell expression such as
    ``$nvcc_version`` or ``$(date -u +%FT%TZ)``), not a literal."""


def marker_command(path: str, fields, drop: str | None = None) -> str:
    """The one way every stage writes its marker (``<lab_root>/markers/<stage>.done``): ``key=value``
    lines into ``<path>.part``, renamed over ``path`` (a marker is whole or absent), then the
    stage's marker under an old name (``drop``) removed. A POSIX shell command, for a stage's
    script and for an operation alike; run it only after the stage's proofs passed."""
    import shlex

    def line(key, value):
        text = f"{key}={value}"
        if isinstance(value, OnBox):
            return '"' + text.replace('"', '\\"') + '"'
        return shlex.quote(text)

    p = shlex.quote(path)
    command = (f"mkdir -p {shlex.quote(str(Path(path).parent))} && "
               f"printf '%s\\n' {' '.join(line(k, v) for k, v in fields)} > {p}.part && mv -f {p}.part {p}")
    return command + (f" && rm -f {shlex.quote(drop)}" if drop else "")


# ------------------------------------------------------------------ folders only root can change


def _writable_by_others(mode: str) -> bool:
    try:
        return bool(int(mode, 8) & 0o022)
    except ValueError:
        return True


def _sticky(mode: str) -> bool:
    try:
        return bool(int(mode, 8) & 0o1000)
    except ValueError:
        return False


def root_only_problem(path: str, chain: dict | None) -> str | None:
    """Why root must not work in the folder ``path`` (None: only root can change it or what leads to it),
    from the RootOnlyChain fact's answer: every folder above it (as it resolves, and above each link on
    the way) root's and writable by no one else, or sticky (``/var/tmp``: others may add names there but
    not rename or remove root's); the folder itself, where it exists, root's, a folder, and writable by
    no one else. A folder that fails this is one whose owner (or a writer above it) can swap a name
    under root's hands for a link to anywhere."""
    if not chain or not chain.get("canonical"):
        return "the box did not say who owns the folders above it (readlink/stat printed nothing usable)"
    canonical = chain["canonical"]
    written = {w["path"]: w for w in chain.get("written") or []}
    links = [w for w in written.values() if w["kind"] == "link"]
    for link in links:
        if link["uid"] != 0:
            return (f"{link['path']}, on the way to {path}, is a link of uid {link['uid']}'s, not root's: its owner can "
                    "point it elsewhere")
    itself = written.get(path.rstrip("/") or "/")
    resolved = next((p for p in chain.get("parts") or [] if p["path"] == canonical), None)
    if (not links and canonical != str(Path(path))) or (itself and itself["kind"] == "none" and resolved) \
            or (itself and itself["kind"] == "dir" and not resolved):
        return (f"{path} changed while the box was asked about it (what its name is and where it leads disagree): "
                "someone is swapping that name")
    via = f" (a link to {canonical})" if links and itself and itself["kind"] == "link" else ""
    for part in chain.get("parts") or []:
        where, uid, mode = part["path"], part["uid"], part["mode"]
        if where == canonical:
            if not part["dir"]:
                return f"{path}{via} is a file, not a folder"
            if uid != 0:
                return f"{path}{via} belongs to uid {uid}, not root: its owner can put links in it where root writes"
            if _writable_by_others(mode):
                return f"{path}{via} has mode {mode}: others can write in it, where root writes"
        elif uid != 0:
            return (f"{where}, above {path}{via}, belongs to uid {uid}, not root: its owner can rename what is in it "
                    "and put a link in its place")
        elif _writable_by_others(mode) and not _sticky(mode):
            return (f"{where}, above {path}{via}, has mode {mode}: others can rename what is in it and put a link "
                    "in its place")
    return None


def missing_under_shared(chain: dict) -> list[str]:
    """The folders of the chain's path still to be made, top first, when the deepest existing one above
    them others can write in (a sticky ``/var/tmp``): anyone could make one of those names first, so each
    is made by ``root_dir_command``. [] where nothing is missing or only root can write where they go (a
    plain ``mkdir -p`` is safe there)."""
    canonical = chain["canonical"]
    existing = {p["path"]: p for p in chain.get("parts") or []}
    missing, at = [], canonical
    while at not in existing and at != "/":
        missing.append(at)
        at = str(Path(at).parent)
    if not missing or not _writable_by_others(existing.get(at, {}).get("mode", "755")):
        return []
    return missing[::-1]


def root_dir_command(path: str, mode: str = "755") -> str:
    """Shell: make ``path`` root's own folder in a folder others can write in, or stop. ``mkdir`` without
    ``-p`` fails on anything already in its place (a link, someone else's folder), and what is there
    after is checked: a folder, not a link, root's, writable by no one else. Run as root."""
    import shlex

    p = shlex.quote(path)
    why = shlex.quote(f"verl-lab: {path} is not a folder of root's alone (a link, or someone else's folder, took its "
                      "name first): nothing was done in it; remove it and run the deploy again")
    return (f"mkdir -m {mode} {p} 2>/dev/null; if [ -L {p} ] || [ ! -d {p} ] || [ \"$(stat -c %u {p})\" != 0 ] "
            f"|| [ -n \"$(find {p} -maxdepth 0 -perm /022)\" ]; then echo {why} >&2; exit 1; fi")
