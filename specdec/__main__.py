import sys

from specdec.entrypoints.cli import main

sys.exit(main())
