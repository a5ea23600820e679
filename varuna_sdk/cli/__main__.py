"""``python -m varuna_sdk.cli ARGS``: the ``varuna`` command (``varuna_sdk.cli.main``), for a
machine where the console script is not on PATH. Imports only ``varuna_sdk.cli``."""

import sys

from . import main

sys.exit(main())
