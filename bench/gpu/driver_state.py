"""What the driver stage reads on a box with a real, loaded NVIDIA driver (read only: installs nothing).

    python3 bench/gpu/driver_state.py OUT_DIR

writes OUT_DIR/driver-state.txt: the DriverState fact's one command (verl_lab_box/nvidia_driver.py
fact_command, with the stage's own arguments) and what the box printed, then /etc/os-release and
nvidia-smi's driver query, for a recorded case in tests/fixtures/facts/driver.DriverState/.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.driver import PIN_FILE, SOURCES_FILE, load_table  # noqa: E402
from tasks.settings import TRAIN_UNIT  # noqa: E402
from verl_lab_box.nvidia_driver_state import fact_command  # noqa: E402


def main(out_dir: str) -> int:
    command = fact_command(PIN_FILE, TRAIN_UNIT, SOURCES_FILE, tuple(load_table().watch()))
    fact = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    extra = subprocess.run(["sh", "-c", "cat /etc/os-release; nvidia-smi --query-gpu=index,name,compute_cap,"
                                        "driver_version --format=csv,noheader; uname -r"], capture_output=True, text=True)
    text = (f"=== command\n{command}\n=== output (rc {fact.returncode})\n{fact.stdout}"
            f"=== stderr\n{fact.stderr}=== os-release, nvidia-smi, uname -r\n{extra.stdout}{extra.stderr}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "driver-state.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
