"""A plain venv at the env's prefix of lab boxes, with real packages from the cached PyPI wheels
(tests/fixtures/standins/env.py's wheelhouse), for the e2e modules whose boxes need Ray or TensorBoard in the env
but not the env stage (a full env takes too long there): the units then run them as they would in a real env."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

ENV = "/opt/verl-lab/envs/verl"
# each package and what it needs, as pip resolves them from the wheelhouse
WHEELS = {
    "ray==2.46.0": {"ray", "attrs", "certifi", "charset_normalizer", "click", "filelock", "idna", "jsonschema",
                    "jsonschema_specifications", "msgpack", "packaging", "protobuf", "pyyaml", "referencing",
                    "requests", "rpds_py", "typing_extensions", "urllib3"},
    "tensorboard==2.20.0": {"tensorboard", "tensorboard_data_server", "absl_py", "grpcio", "markdown", "numpy",
                            "packaging", "pillow", "protobuf", "setuptools", "werkzeug", "markupsafe",
                            "typing_extensions"},
}


def install_env(boxes, *packages: str) -> None:
    """``packages`` (keys of WHEELS) into a new venv at ENV on each box, side by side; the wheels copied into the
    box's /var/tmp and removed after."""
    from tests.fixtures.standins.env import wheelhouse

    names = set().union(*(WHEELS[p] for p in packages))
    wheels = [w for w in wheelhouse().glob("*.whl") if w.name.split("-")[0].lower() in names]

    def one(box):
        dest = box.root / "var/tmp/env-wheels"
        dest.mkdir(parents=True, exist_ok=True)
        for whl in wheels:
            shutil.copy(whl, dest / whl.name)
        box.ssh(f"python3 -m venv {ENV} && {ENV}/bin/pip install -q --compile --no-index --find-links /var/tmp/env-wheels "
                f"{' '.join(packages)} && rm -rf /var/tmp/env-wheels", timeout=900)

    with ThreadPoolExecutor(len(boxes)) as pool:
        list(pool.map(one, boxes))
