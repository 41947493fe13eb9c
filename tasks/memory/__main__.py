"""``python -m tasks.memory``."""

import sys

from tasks.memory.cli import main

sys.exit(main())
