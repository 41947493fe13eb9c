"""Whether the box can reach a Hugging Face endpoint and what it answers for one repo at one
revision (direct mode: the box downloads the model and data itself).

One GET of the Hub API's ``/api/{models,datasets}/{repo}/revision/{rev}`` with the box's own
``python3`` (standard library, no token: the token reaches the box only with the data stage), so
the run's checks (tasks/base.py) refuse a repo or revision the endpoint does not serve, or an
endpoint the box cannot reach, before anything changes. A 401/403 answer cannot tell a missing
repo from a private or gated one without the token: it is not judged here.
"""

from __future__ import annotations

import json
import shlex

from pyinfra.api import FactBase

PROBE = r'''
import json, sys, urllib.error, urllib.request
url = sys.argv[1]
out = {"url": url, "status": None, "code": None, "json": None, "error": None}
try:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "verl-lab-probe"}),
                                timeout=float(sys.argv[2])) as r:
        out["status"] = r.status
        body = r.read(8 << 20)
        try:
            out["json"] = isinstance(json.loads(body), dict)
        except ValueError:
            out["json"] = False
except urllib.error.HTTPError as e:
    out["status"], out["code"] = e.code, e.headers.get("X-Error-Code")
except Exception as e:
    out["error"] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out, sort_keys=True))
'''
TIMEOUT_S = 8


def api_url(endpoint: str, repo_type: str, repo: str, revision: str) -> str:
    kind = "models" if repo_type == "model" else "datasets"
    return f"{endpoint.rstrip('/')}/api/{kind}/{repo}/revision/{revision}"


class EndpointServes(FactBase[dict | None]):
    """``{"url", "status", "code" (X-Error-Code), "json" (a JSON object came back), "error"}`` for
    one Hub API URL, asked from the box; ``{"skipped": true}`` where ``dest`` already holds the snapshot
    of ``digest`` (its verified stamp: the endpoint is not asked); the default, None, where the box printed
    nothing (no python3)."""

    @staticmethod
    def default() -> None:
        return None

    def command(self, url: str, python: str = "python3", dest: str | None = None, digest: str | None = None) -> str:
        probe = (f"command -v {shlex.quote(python)} >/dev/null 2>&1 && "
                 f"{shlex.quote(python)} -c {shlex.quote(PROBE)} {shlex.quote(url)} {TIMEOUT_S} || true")
        if not (dest and digest):
            return probe
        # a snapshot already verified on the box (its stamp holds the spec's digest): the endpoint is not asked
        stamp = shlex.quote(dest + ".verified.json")
        return (f"if [ -d {shlex.quote(dest)} ] && grep -qF {shlex.quote(digest)} {stamp} 2>/dev/null; "
                f"then echo '{{\"skipped\": true}}'; else {probe}; fi")

    def process(self, output) -> dict | None:
        for line in output:
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    return None
        return None


def served_problem(answer: dict | None, what: str, fix_key: str, endpoint: str) -> str | None:
    """Why the endpoint does not serve ``what`` to this box (None: it does, or the box cannot tell)."""
    fix_mirror = "set mirror_urls.huggingface to an endpoint that carries it (or artifact_mode = 'relay')"
    if answer is None or answer.get("skipped"):
        return None
    if answer.get("error"):
        return (f"{what}: the box cannot reach the HF endpoint {endpoint} ({answer['error']}), and in direct "
                f"mode the box downloads it. Fix: {fix_mirror}")
    status, code = answer.get("status"), answer.get("code")
    if status == 404 and code == "RevisionNotFound":
        return f"{what}: the HF endpoint {endpoint} has no such revision. Fix: pin an existing commit in {fix_key}.revision"
    if status == 404:
        return (f"{what}: the HF endpoint {endpoint} has no such repo (HTTP 404{', ' + code if code else ''}). "
                f"Fix: check {fix_key}.repo, or {fix_mirror}")
    if status == 200 and answer.get("json") is False:
        return (f"{what}: the HF endpoint {endpoint} did not answer the Hub API (not JSON: an HTML login, captcha "
                f"or error page?). Fix: {fix_mirror}")
    if status is not None and status >= 500:
        return f"{what}: the HF endpoint {endpoint} answered HTTP {status}. Fix: retry later, or {fix_mirror}"
    return None
