"""`python -m specbench.cli`: the `specbench` command without the console script (a checkout not installed)."""

import sys

from .main import main

sys.exit(main())
