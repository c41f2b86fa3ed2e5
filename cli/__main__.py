"""`python -m specdec.cli ...` is `specdec ...` (coordinator/cluster.py starts the services this way)."""

import sys

from specdec.cli.main import main

sys.exit(main())
