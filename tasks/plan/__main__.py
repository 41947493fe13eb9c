"""``python -m tasks.plan`` (tasks/plan/cli.py)."""

import sys

from tasks.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
