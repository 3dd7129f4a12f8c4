"""The CUDA allocator's view of a streaming step: run ``benchmarks.realshape`` with the memory
history recorded (the step before the first timed one, and the first two timed ones), then print
what the state holds, what the step before left behind, and the live blocks at each step's
peak grouped by the code that allocated them. GPU only; ``WARMUP`` must equal ``--warmup``.

Usage: ``WARMUP=4 python scripts/memory_trace.py --preset wan-1.3b-480p --device cuda --sides
prepared --compile --method streaming --checkpointing attention --steps 2 --warmup 4``.
"""

import collections
import json
import os
import sys

import torch

import benchmarks.common as c
import benchmarks.realshape as rs
from fvstep.core.tree import leaves

WARMUP = int(os.environ.get("WARMUP", "4"))
calls = {"n": 0}
orig = c.time_call
report = []


def key_of(frames):
    keep = []
    for f in frames:
        fn = f["filename"]
        if "/torch/" in fn and "torchinductor" not in fn:
            continue
        keep.append(f"{fn.split('/site/')[-1].split('/.snap/')[-1]}:{f['line']}:{f['name']}")
        if len(keep) == 3:
            break
    return " < ".join(keep) or "(torch internals)"


def traced(fn, device):
    if not (hasattr(fn, "keywords") and "parallelism" in (fn.keywords or {})):
        return orig(fn, device)
    i = calls["n"]
    calls["n"] += 1
    if i == WARMUP - 1:  # record the step before: what it leaves behind
        torch.cuda.memory._record_memory_history(
            max_entries=3_000_000, stacks="python", context="alloc"
        )
        return orig(fn, device)
    if i < WARMUP or i > WARMUP + 1:
        return orig(fn, device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    state = fn.args[0]
    seen = set()
    held = collections.Counter()

    def walk(x, label):
        for t in leaves(x):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                st = t.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    held[label] += st.nbytes()

    for rname, role in state.roles.items():
        walk(role.params, rname + ".params")
        walk(role.opt_state, rname + ".opt")
        for a in role.__attrs_attrs__:
            if a.name not in ("params", "opt_state", "module"):
                walk(getattr(role, a.name), rname + "." + a.name)
        mod = state.module(rname)
        for prm in mod.parameters():
            walk(prm, rname + ".module_params")
            if prm.grad is not None:
                walk(prm.grad, rname + ".GRAD")
        for b in mod.buffers():
            walk(b, rname + ".buffers")
    walk(state.extra, "extra")
    walk(fn.args[1], "batch")
    print(
        "STATE",
        {k: round(v / 2**30, 3) for k, v in held.items()},
        "sum",
        sum(held.values()) / 2**30,
        "allocated",
        base / 2**30,
        flush=True,
    )
    if i == WARMUP:
        snap0 = torch.cuda.memory._snapshot()
        live0 = {}
        for e in snap0["device_traces"][0]:
            if e["action"] == "alloc":
                live0[e["addr"]] = (e["size"], e.get("frames", []))
            elif e["action"] == "free_completed":
                live0.pop(e["addr"], None)
        g0 = collections.Counter()
        n0 = collections.Counter()
        for size, frames in live0.values():
            k = key_of(frames)
            g0[k] += size
            n0[k] += 1
        print("LEFT BY THE STEP BEFORE", sum(g0.values()) / 2**30, flush=True)
        for k, v in g0.most_common(25):
            print("    ", round(v / 2**30, 3), n0[k], k, flush=True)
        torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(
        max_entries=3_000_000, stacks="python", context="alloc"
    )
    out = orig(fn, device)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_stat = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][0]
    live = {}
    cur = 0
    peak = 0
    at_peak = None
    unknown_free = 0
    for e in trace:
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            cur += e["size"]
            if cur > peak:
                peak = cur
                at_peak = dict(live)
        elif a == "free_completed":
            if e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
            else:
                cur -= e["size"]
                unknown_free += e["size"]
    groups = collections.Counter()
    counts = collections.Counter()
    for size, frames in (at_peak or {}).values():
        k = key_of(frames)
        groups[k] += size
        counts[k] += 1
    r = {
        "call": i,
        "seconds": out[0],
        "base_gib": base / 2**30,
        "peak_stat_gib": peak_stat / 2**30,
        "replayed_peak_gib": (base + peak) / 2**30,
        "freed_from_before_gib": unknown_free / 2**30,
        "entries": len(trace),
        "top": [(round(v / 2**30, 3), counts[k], k) for k, v in groups.most_common(45)],
    }
    report.append(r)
    print(json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
    for row in r["top"]:
        print("   ", row, flush=True)
    return out


c.time_call = traced
rc = rs.main(sys.argv[1:])
with open(os.path.join(os.environ.get("OUT", "/tmp"), "memtrace.json"), "w") as out_file:
    json.dump(report, out_file, indent=1)
print("max_memory_allocated overall", torch.cuda.max_memory_allocated() / 2**30)
sys.exit(rc)
