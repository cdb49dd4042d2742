"""``python -m fullshard.train``: the same as ``fullshard train``."""

import sys

from fullshard.train.cli import main

sys.exit(main())
