"""``python -m capgraph.bench``: the same as ``capgraph bench``."""

import sys

from . import main

sys.exit(main())
