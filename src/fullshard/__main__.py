"""``python -m fullshard ...``: the ``fullshard`` command without its console script."""

import sys

from fullshard.cli import main

sys.exit(main())
