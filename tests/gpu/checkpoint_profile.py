"""Where a synchronous save's time goes on a GPU, beside DCP's own save of the same tensors.

    python -m tests.gpu.checkpoint_profile --preset wan-1.3b --rounds 2 --json profile.json

One process, the state of ``python -m benchmarks.checkpoint`` (a preset's model + AdamW, on the
GPU). Each round times, in a rotating order (each into a fresh directory, removed after):

- ``dcp``: ``dcp.save`` of the flat tensors, nothing of fvstep's;
- ``dcp + checks thread``: the same while a second thread computes fvstep's checksums and
  finiteness (``local_checks``): what ``fvstep.checkpoint.save`` does on one process;
- ``fvstep save``: ``fvstep.checkpoint.save``;
- ``checks, then write``: the checks first, then fvstep's write with them given (no
  overlap); ``checks`` alone is also timed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp

import fvstep.checkpoint as ckpt
from benchmarks import common as c
from benchmarks.checkpoint import build_state
from fvstep.checkpoint import saving
from fvstep.checkpoint.saving import fingerprint, local_checks
from fvstep.core.tree import flatten_with_paths


def timed(fn, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default=None)
    parser.add_argument("--mib", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rt = c.setup_runtime("cuda")
    state, what = build_state(SimpleNamespace(preset=args.preset, mib=args.mib), rt)
    paths, leaves, _ = flatten_with_paths(state)
    nbytes = sum(x.numel() * x.element_size() for x in leaves)
    root = Path(tempfile.mkdtemp(prefix="fvstep-ckpt-profile-"))
    flat = {p: x.detach() for p, x in zip(paths, leaves)}

    def dcp_alone(d: Path) -> None:
        dcp.save(flat, checkpoint_id=d, no_dist=True)

    def dcp_with_checks(d: Path) -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(local_checks, leaves)
            dcp.save(flat, checkpoint_id=d, no_dist=True)
            pending.result()

    def fvstep_save(d: Path) -> None:
        ckpt.save(state, d)

    def checks_then_write(d: Path) -> None:
        sums, finite = local_checks(leaves)
        assert all(finite)
        prints = fingerprint(paths, leaves, sums=sums)
        tmp = saving.make_temp_dir(d, False, None)
        saving.write_checkpoint(paths, leaves, int(state.step), d, tmp, False, None, prints=prints)

    variants = {
        "dcp": dcp_alone,
        "dcp + checks thread": dcp_with_checks,
        "fvstep save": fvstep_save,
        "checks, then write": checks_then_write,
    }
    times: dict[str, list[float]] = {k: [] for k in [*variants, "checks"]}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            d = root / f"{name.replace(' ', '_').replace(',', '').replace('+', 'and')}_{r}"
            times[name].append(timed(variants[name], d))
            shutil.rmtree(d, ignore_errors=True)
            print(f"round {r} {name}: {times[name][-1]:.2f} s", flush=True)
        times["checks"].append(timed(local_checks, leaves))
    shutil.rmtree(root, ignore_errors=True)
    rows = {k: statistics.median(v) for k, v in times.items()}
    mib = nbytes / 2**20
    print(f"{what}: {mib:.0f} MiB, {len(leaves)} leaves, torch {torch.__version__}")
    for k, v in rows.items():
        print(f"{k:22s} {v:8.2f} s  {mib / v:8.0f} MiB/s  {v / rows['dcp']:.2f}x dcp")
    if args.json:
        Path(args.json).write_text(json.dumps({"what": what, "mib": mib, "times": times}))
    c.teardown_runtime(rt)


if __name__ == "__main__":
    main()
