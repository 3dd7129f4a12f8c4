"""Benchmarks of fvstep: one module a benchmark, each run as ``python -m benchmarks.<name>``.

They are applications of fvstep, not part of it: they are not in the wheel, and run from
the repository root (where ``benchmarks`` is importable) against the installed package.

- :mod:`benchmarks.accumulation` — step time, peak memory and collective bytes of the
  accumulation policies (``every``, ``no_sync``, ``deferred``) against K, beside the
  analytic expectation.
- :mod:`benchmarks.overhead` — fvstep's compiled fine-tune step against a hand-written
  imperative (FSDP2) loop, alternated A/B in one process group; fvstep's own CPU time.
- :mod:`benchmarks.checkpoint` — sync/async save, load, and the disk's own sequential
  write bandwidth on the same bytes.
- :mod:`benchmarks.realshape` — the real workload (fine-tune or DMD2 at 480x832x81):
  roles prepared by :func:`fvstep.parallel.prepare` against the same model prepared by
  hand, per-step time of student and critic-only steps, peak memory, MFU, graphs.
- :mod:`benchmarks.data` — the precomputed-latent loader's samples/s and the share of
  a step spent waiting for data.
- :mod:`benchmarks.async_save_vs_dcp`, :mod:`benchmarks.checkpoint_async`,
  :mod:`benchmarks.checksum_finite`, :mod:`benchmarks.sampling`,
  :mod:`benchmarks.tree_flatten` — smaller ones (one process): fvstep's async save
  against DCP's, async save blocking time, the save's finiteness check, sampler time,
  pytree flattening.

The five above them are commands with ``main(argv) -> int``. Helpers, not benchmarks:

- :mod:`benchmarks.reference` — the hand-written imperative loops (fine-tune, DMD2)
  that fvstep is measured against here and tested against bitwise in ``tests/``: the one
  copy of them.
- :mod:`benchmarks.common` — distributed setup, options, timing, memory, tables;
  :mod:`benchmarks.presets` — models and data; :mod:`benchmarks.analytic` — model
  FLOPs (MFU) and the expected FSDP2 collectives; :mod:`benchmarks.profiling` — the
  hook that sets fvstep's own host time apart from the work it calls.

Run on one process (unsharded) or under ``torchrun`` (every role sharded with FSDP2;
gloo on CPU, NCCL on CUDA). Only rank 0 prints and writes files. Performance is
measured here and never asserted in tests.

Examples:
    $ python -m benchmarks.accumulation --preset tiny-wan --k 1 2 --steps 3 --warmup 1
    $ torchrun --standalone --nproc_per_node 2 -m benchmarks.overhead --preset tiny-wan
"""

__all__ = [
    "accumulation",
    "analytic",
    "async_save_vs_dcp",
    "checkpoint",
    "checkpoint_async",
    "checksum_finite",
    "common",
    "data",
    "overhead",
    "presets",
    "profiling",
    "realshape",
    "reference",
    "sampling",
    "tree_flatten",
]
