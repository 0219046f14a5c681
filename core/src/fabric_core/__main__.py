"""``python -m fabric_core`` is the ``fabric`` command (useful when the console script is not on PATH)."""

import sys

from fabric_core.cli import main

sys.exit(main())
