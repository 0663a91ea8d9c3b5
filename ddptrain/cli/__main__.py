"""``python -m ddptrain.cli ...``: the ``ddptrain`` command (as ``python -m ddptrain``)."""

import sys

from ddptrain.cli.main import main

sys.exit(main())
