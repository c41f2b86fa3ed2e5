"""`python -m cli ...` is `specdec ...` (coordinator/cluster.py starts the services this way)."""

import sys

from cli.main import main

sys.exit(main())
