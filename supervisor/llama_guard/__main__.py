"""``python -m llama_guard``: the same as the ``llama-guard`` console script."""

import sys

from llama_guard.cli import main

sys.exit(main())
