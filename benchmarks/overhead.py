"""Thin wrapper: `python benchmarks/overhead.py --help` (same as `fvstep bench overhead`).

See :mod:`fvstep.bench.overhead` for what is measured and how. Under torchrun every rank runs
this file; only rank 0 prints.
"""

import sys

from fvstep.bench.overhead import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
