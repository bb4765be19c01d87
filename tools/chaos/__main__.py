"""`python -m tools.chaos`: the chaos soak (scripts/chaos runs this)."""

import sys

from tools.chaos.run import main

sys.exit(main())
