"""Put catalog artifacts on boxes, verified, in relay or direct mode (pyinfra operations)."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FileUploadCommand, StringCommand, operation

from tasks.catalog import Artifact
from tasks.facts.files import VerifiedArtifact
from tasks.failure import failing_command
from tasks.fetch import Expected, FetchError, box_fetch_script, box_verify_script, download
from tasks.settings import LabSettings


def controller_copy(settings: LabSettings, art: Artifact):
    """Download (once, cached, verified) an artifact into the controller cache; return its path."""
    dest = settings.controller_cache / "artifacts" / art.name / art.version / art.filename
    return download(art.url(settings.mirrors), dest, Expected(art.sha256, art.size))


def box_path(settings: LabSettings, art: Artifact) -> str:
    return f"{settings.box_cache}/{art.name}/{art.filename}"


@operation(is_idempotent=True)
def artifact_file(settings: LabSettings, artifact: str, dest: str | None = None):
    """
    Place a verified copy of catalog artifact ``name`` on the box.

    + settings: the host's LabSettings
    + artifact: catalog artifact name (kind ``file``)
    + dest: where to put it (default: the box-side artifact cache)

    **Example:**

    .. code:: python

        artifact_file(name="Fetch cuDNN", settings=settings, artifact="cudnn_archive")
    """
    art = settings.catalog.artifact(artifact)
    dest = dest or box_path(settings, art)
    stamp = host.get_fact(VerifiedArtifact, path=dest)
    if stamp and stamp["sha256"] == (art.sha256 or "no-sha256"):
        host.noop(f"{art.name} {art.version} already verified at {dest}")
        return
    if settings.artifact_mode == "relay":
        try:
            local = controller_copy(settings, art)
        except FetchError as exc:
            # Fail this host only (every host needing the artifact fails the same way),
            # with the fetcher's message; the run goes on for hosts that don't need it.
            yield failing_command(f"verl-lab: relay download of {art.name} failed on the controller: {exc}")
            return
        part = dest + ".part"
        yield StringCommand("mkdir", "-p", shlex.quote(dest.rsplit("/", 1)[0]))
        yield FileUploadCommand(str(local), part)
        yield StringCommand("sh", "-c", shlex.quote(box_verify_script(part, dest, art.sha256, art.name)))
    else:
        script = box_fetch_script(art.url(settings.mirrors), dest, art.sha256, art.size)
        yield StringCommand("sh", "-c", shlex.quote(script))
