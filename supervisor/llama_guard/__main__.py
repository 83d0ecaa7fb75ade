"""``python -m llama_guard``: the same as the ``llama-guard`` console script."""

import sys

from llama_guard.app.cli import main

sys.exit(main())
