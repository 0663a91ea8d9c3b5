"""``python -m ddptrain ...``: the ``ddptrain`` command."""

import sys

from ddptrain.cli import main

sys.exit(main())
