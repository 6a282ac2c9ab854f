"""``python -m gym_fork.cli``."""

import sys

from gym_fork.cli import main

sys.exit(main())
