"""``python -m specdec.entrypoints.openai``: the same as ``...openai.api_server``."""

import sys

from specdec.entrypoints.openai.api_server import main

sys.exit(main())
