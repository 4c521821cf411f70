"""`python -m k3load` is the `k3load` command."""

import sys

from k3load.cli import main

sys.exit(main())
