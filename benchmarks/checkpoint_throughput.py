"""Thin wrapper: `python benchmarks/checkpoint_throughput.py --help` (same as `fvstep bench checkpoint`).

See :mod:`fvstep.bench.checkpoint` for what is measured and how. Under torchrun every rank runs
this file; only rank 0 prints.
"""

import sys

from fvstep.bench.checkpoint import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
