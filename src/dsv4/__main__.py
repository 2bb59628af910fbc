"""`python -m dsv4 ...` runs the `dsv4` command line."""

import sys

from dsv4.cli import main

sys.exit(main())
