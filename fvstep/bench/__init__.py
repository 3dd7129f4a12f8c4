"""Benchmarks of fvstep: each module is a command with ``main(argv) -> int``.

- :mod:`fvstep.bench.accumulation` — step time, peak memory and collective bytes of the
  accumulation policies (``every``, ``no_sync``, ``deferred``) against K, beside the
  analytic expectation.
- :mod:`fvstep.bench.overhead` — fvstep's compiled fine-tune step against a hand-written
  imperative (FSDP2) loop, alternated A/B in one process group; fvstep's own CPU time.
- :mod:`fvstep.bench.checkpoint` — sync/async save, load, and the disk's own sequential
  write bandwidth on the same bytes.
- :mod:`fvstep.bench.realshape` — the real workload (fine-tune or DMD2 at 480x832x81):
  roles prepared by :func:`fvstep.parallel.prepare` against the same model prepared by
  hand, per-step time of student and critic-only steps, peak memory, MFU, graphs.
- :mod:`fvstep.bench.data` — the precomputed-latent loader's samples/s and the share of
  a step spent waiting for data.
- :mod:`fvstep.bench.reference` — the hand-written imperative loops (fine-tune, DMD2)
  that fvstep is measured against here and tested against bitwise in ``tests/``: the one
  copy of them.
- :mod:`fvstep.bench.common` — distributed setup, options, timing, memory, tables;
  :mod:`fvstep.bench.presets` — models and data; :mod:`fvstep.bench.analytic` — model
  FLOPs (MFU) and the expected FSDP2 collectives; :mod:`fvstep.bench.profiling` — the
  hook that sets fvstep's own host time apart from the work it calls.

Run on one process (unsharded) or under ``torchrun`` (every role sharded with FSDP2;
gloo on CPU, NCCL on CUDA). Only rank 0 prints and writes files. Performance is
measured here and never asserted in tests.

Examples:
    $ python benchmarks/accumulation.py --preset tiny-wan --k 1 2 --steps 3 --warmup 1
    $ torchrun --standalone --nproc_per_node 2 benchmarks/overhead.py --preset tiny-wan
"""

__all__ = [
    "accumulation",
    "analytic",
    "checkpoint",
    "common",
    "data",
    "overhead",
    "presets",
    "profiling",
    "realshape",
    "reference",
]
