"""``python -m manygpu`` is the ``manygpu`` command."""

import sys

from manygpu.cli.main import main

sys.exit(main())
