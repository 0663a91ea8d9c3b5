"""``python -m ddptrain ...``: the ``ddptrain`` command."""

import sys

from ddptrain.cli.main import main

sys.exit(main())
