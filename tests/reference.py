"""The hand-written reference loops, for tests: a re-export of :mod:`fvstep.bench.reference`.

There is one copy of each loop, in the package (the benchmark ships in the wheel and needs
it; see ``docs/architecture.md``). Tests may import it from here or from there.
"""

from fvstep.bench.reference import (
    dmd2_loop,
    finetune_loop,
    finetune_step,
    flow_matching_by_hand,
    microbatches,
    modules_view,
    reshard_all,
    run_unit,
    shard_by_hand,
    unit_key,
)

__all__ = [
    "dmd2_loop",
    "finetune_loop",
    "finetune_step",
    "flow_matching_by_hand",
    "microbatches",
    "modules_view",
    "reshard_all",
    "run_unit",
    "shard_by_hand",
    "unit_key",
]
