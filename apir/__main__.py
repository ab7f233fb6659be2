"""`python -m apir ...` runs the `apir` command (apir.cli), with no PATH set-up needed."""

import sys

from apir.cli import entry

sys.exit(entry())
