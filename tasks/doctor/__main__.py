"""``python -m tasks.doctor`` (tasks/doctor/diagnosis.py)."""

import sys

from tasks.doctor.diagnosis import main

if __name__ == "__main__":
    sys.exit(main())
