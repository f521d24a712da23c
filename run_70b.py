#!/usr/bin/env python3
"""Entry point: `python run_70b.py [command] [flags]` (same as the `sequoia-offload` command)."""

import sys

from offload_engine.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
