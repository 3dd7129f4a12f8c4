"""Thin wrapper: `python benchmarks/accumulation.py --help` (same as `fvstep bench accumulation`).

See :mod:`fvstep.bench.accumulation` for what is measured and how. Under torchrun every rank runs
this file; only rank 0 prints.
"""

import sys

from fvstep.bench.accumulation import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
