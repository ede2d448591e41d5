"""`python -m psr.cli ...`: the same as `psr ...`."""

import sys

from psr.cli import main

sys.exit(main())
