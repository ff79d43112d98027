"""``python -m kvserve.bench.soak``: the soak's command line."""

import sys

from kvserve.bench.soak.launcher import main

sys.exit(main())
