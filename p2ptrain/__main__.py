"""`python -m p2ptrain` runs the command line."""

import sys

from p2ptrain.cli.main import main

sys.exit(main())
