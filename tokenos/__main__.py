"""`python -m tokenos ...` is the `tokenos` command."""

import sys

from tokenos.entrypoints.cli import main

sys.exit(main())
