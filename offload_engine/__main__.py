"""`python -m offload_engine ...` is `sequoia-offload ...`."""

import sys

from .apps.cli import main

sys.exit(main())
