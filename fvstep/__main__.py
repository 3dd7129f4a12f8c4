"""``python -m fvstep`` is the ``fvstep`` command."""

import sys

from fvstep.cli import main

sys.exit(main())
