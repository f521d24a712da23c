"""`python -m offload_engine ...` is `sequoia-offload ...`."""

import sys

from .apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
