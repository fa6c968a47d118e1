"""``python -m megaport.train.harness``: one run of the harness's worker (see megaport.train.harness)."""

import os
import sys

from megaport.train.harness.worker import main

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
sys.exit(main())
