"""`python -m converters.cli ...`: the `qformats` command line."""

import sys

from converters.cli import main

sys.exit(main())
