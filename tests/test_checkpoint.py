"""Checkpoints: the laws of ``fvstep.checkpoint``.

1. Round trip: ``load(save(state), like=other)`` is bitwise ``state``; ``like`` is untouched
   and the loaded leaves are fresh tensors (1 process, drawn states; 2 ranks, FSDP2).
2. Per-rank values come back to their own rank, never collapsed to rank 0's.
3. Resharding: saved on 2 ranks, loaded on 1, and the other way round, leaf-exact.
4. Atomic commit: ``latest`` and ``list_complete`` never pick a temporary, manifest-less
   or damaged directory; ``prune`` keeps the newest; nothing is silently overwritten.
5. Crash safety: a saver killed with SIGKILL at random points of its saves always leaves
   a loadable ``latest`` (a forked saver process, ``tests/crash_saver.py``).
6. Bad input: a clear error naming the path, and nothing changed on disk.
7. Async: the checkpoint holds the state at call time; a background failure surfaces at
   the next ``save``/``wait``/``close``.

``-m heavy`` runs more examples and more crash trials.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep import parallel as fsp
from fvstep.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    directories,
    latest,
    list_complete,
    load,
    save,
    saving,
)
from fvstep.checkpoint.saving import FORMAT_VERSION, MANIFEST_NAME, read_manifest
from fvstep.core import tree
from fvstep.testing import train_states

ROOT = Path(__file__).resolve().parent.parent
NUM_CRASH_TRIALS = 10
NUM_CRASH_TRIALS_HEAVY = 100


# --------------------------------------------------------------------------- helpers


def zeros_like_state(state):
    """An independent state of the same structure (and static metadata), every leaf zero."""
    like = tree.clone(state)
    with torch.no_grad():
        for x in tree.leaves(like):
            x.zero_()
    return like


def storage_ptrs(state) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in tree.leaves(state) if x.numel()}


def small_net(seed: int, width: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(width, 8), nn.Linear(8, 3)).to(dtype)


def small_state(
    *,
    seed: int = 0,
    width: int = 4,
    teacher_dtype: torch.dtype = torch.float32,
    teacher: bool = True,
    critic: bool = False,
) -> fs.TrainState:
    """A trained student (AdamW + EMA), a frozen teacher, extra state; drawn values."""
    roles = {
        "student": fs.Role(
            small_net(seed, width), optimizer=fs.optim.adamw(lr=1e-3), ema=fs.EMA(0.9)
        )
    }
    if teacher:
        roles["teacher"] = fs.Role(small_net(seed + 1, dtype=teacher_dtype))
    if critic:
        roles["critic"] = fs.Role(small_net(seed + 2), optimizer=fs.optim.sgd(lr=0.1))
    state = fs.TrainState.create(
        roles, key=fs.random.key(seed), extra={"cache": [torch.arange(6.0).reshape(2, 3)]}
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for x in tree.leaves(state):
            if x.is_floating_point():
                x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        state.step.fill_(3)
    return state


def disk_snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` with the SHA-256 of its content (``<dir>`` for folders)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def shard_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.distcp"))
    assert files, f"no .distcp file in {path}"
    return files


def corrupt_leaf_bytes(path: Path, leaf: str, value: torch.Tensor) -> None:
    """Flip bytes inside the stored data of ``leaf`` (whose saved value is ``value``), so DCP
    still reads the file but the tensor it returns differs."""
    raw = value.detach().contiguous().view(torch.uint8).numpy().tobytes()
    assert len(raw) >= 16, "pick a leaf with a few elements"
    for f in shard_files(path):
        blob = bytearray(f.read_bytes())
        at = blob.find(raw)
        if at >= 0:
            for i in range(at, at + 8):
                blob[i] ^= 0x5A
            f.write_bytes(bytes(blob))
            return
    raise AssertionError(f"the bytes of {leaf!r} were not found in the shards of {path}")


def assert_loads_as(path: Path, expected, like) -> None:
    loaded = load(path, like=like)
    tree.assert_trees_equal(loaded, expected, check_static=False)


# --------------------------------------------------------------- 1. round trip, 1 rank


def check_round_trip(state) -> None:
    like = zeros_like_state(state)
    like_before = tree.clone(like)
    like_leaves = tree.leaves(like)
    with tempfile.TemporaryDirectory() as tmp:
        path = save(state, checkpoint_dir(tmp, int(state.step)))
        loaded = load(path, like=like)
        assert read_manifest(path).step == int(state.step)
    tree.assert_trees_equal(loaded, state)
    # like is untouched: the same tensor objects, with the same bits
    assert all(a is b for a, b in zip(tree.leaves(like), like_leaves))
    tree.assert_trees_equal(like, like_before)
    # the loaded leaves are fresh tensors: no storage shared with like (or the original)
    assert not storage_ptrs(loaded) & (storage_ptrs(like) | storage_ptrs(state))
    for got, want in zip(tree.leaves(loaded), tree.leaves(state)):
        assert got.requires_grad == want.requires_grad
        assert isinstance(got, nn.Parameter) == isinstance(want, nn.Parameter)


@settings(max_examples=12, deadline=None)
@given(state=train_states())
def test_save_load_round_trip_is_bitwise(state):
    check_round_trip(state)


@pytest.mark.heavy
@settings(max_examples=150, deadline=None)
@given(state=train_states(max_roles=4))
def test_save_load_round_trip_is_bitwise_heavy(state):
    check_round_trip(state)


# ------------------------------------------------- 2./3. two ranks, per-rank, resharding


def wan_state(rank: int, *, sharded: bool, seed: int = 0, extra=None, fill: int | None = 0):
    """tiny_wan student (AdamW + EMA) and frozen teacher, sharded with FSDP2 on a CPU mesh
    or plain; float leaves filled with values drawn from ``fill`` (None: left as built)."""
    from fvstep.methods.models import tiny_wan

    mesh = fsp.make_mesh(device_type="cpu") if sharded else None

    def module(s: int) -> nn.Module:
        m = tiny_wan(seed=s, num_layers=1)
        return fsp.shard_module(m, mesh=mesh) if sharded else m

    state = fs.TrainState.create(
        {
            "student": fs.Role(module(seed), optimizer=fs.optim.adamw(lr=1e-3), ema=fs.EMA(0.9)),
            "teacher": fs.Role(module(seed + 1)),
        },
        key=fs.random.key(seed),
        extra=extra or {},
    )
    if fill is not None:
        with torch.no_grad():
            for i, x in enumerate(tree.leaves(state)):
                if not x.is_floating_point():
                    continue
                if hasattr(x, "to_local"):  # each rank draws its own shard
                    local = x.to_local()
                    gen = torch.Generator().manual_seed(fill * 100_003 + i * 17 + rank)
                    local.copy_(torch.randn(local.shape, generator=gen))
                else:
                    gen = torch.Generator().manual_seed(fill * 100_003 + i * 17)
                    x.copy_(torch.randn(x.shape, generator=gen))
            state.step.fill_(5)
    return state


def full_tensors(state) -> dict[str, torch.Tensor]:
    paths, leaves, _ = tree.flatten_with_paths(state)
    return {
        p: (x.full_tensor() if hasattr(x, "to_local") else x).detach().clone()
        for p, x in zip(paths, leaves)
    }


def round_trip_on_ranks(rank: int, world_size: int, root: str):
    extra = {"per_rank": torch.tensor([rank]), "shared": torch.tensor([7])}
    state = wan_state(rank, sharded=True, extra=extra)
    path = save(state, checkpoint_dir(root, 5))
    like = wan_state(rank, sharded=True, seed=1, fill=None, extra=zeros_like_state(extra))
    like_digest = tree.tree_digest(like)
    loaded = load(path, like=like)
    tree.assert_trees_equal(loaded, state, check_static=False)
    assert tree.tree_digest(like) == like_digest
    manifest = read_manifest(path)
    leaves = tree.leaves(loaded)
    return {
        "per_rank": int(loaded.extra["per_rank"]),
        "shared": int(loaded.extra["shared"]),
        "manifest_per_rank": manifest.per_rank,
        "manifest_world": manifest.world_size,
        "num_sharded": sum(hasattr(x, "to_local") for x in leaves),
        "num_sharded_in_manifest": sum(e["sharded"] for e in manifest.leaves.values()),
    }


@pytest.mark.multirank
def test_round_trip_on_two_ranks_is_bitwise_and_per_rank_values_return_to_their_rank(
    ranks, tmp_path
):
    results = ranks.run(round_trip_on_ranks, str(tmp_path))
    assert [r["per_rank"] for r in results] == [0, 1]  # rank 1 gets 1, not rank 0's 0
    assert [r["shared"] for r in results] == [7, 7]
    for r in results:
        assert r["manifest_world"] == 2
        assert set(r["manifest_per_rank"]) == {"extra.per_rank"}
        assert len(r["manifest_per_rank"]["extra.per_rank"]) == 2
        assert r["num_sharded"] > 0 and r["num_sharded"] == r["num_sharded_in_manifest"]
    assert sorted(os.listdir(tmp_path)) == ["step_000000005"]


def async_round_trip_on_ranks(rank: int, world_size: int, root: str, slow_commit_s: float = 0):
    """Save in the background, update in place, close, load. With ``slow_commit_s``, rank
    0's commit (the rename into ``step_<n>``) is held back that long: a rank whose
    ``close()`` returned before the commit would then find no checkpoint to load."""
    from fvstep.checkpoint import saving

    extra = {"per_rank": torch.tensor([rank]), "shared": torch.tensor([7])}
    state = wan_state(rank, sharded=True, extra=extra)
    expected = tree.clone(state)
    write = saving.Manifest.write  # rank 0's commit: the manifest, then the rename

    def slow_write(*args, **kwargs):
        time.sleep(slow_commit_s)  # widens the window of a race; synchronises nothing
        return write(*args, **kwargs)

    if slow_commit_s and rank == 0:
        saving.Manifest.write = slow_write
    try:
        with ckpt.AsyncSaver() as saver:
            saver.save(state, checkpoint_dir(root, 5))
            with torch.no_grad():  # the next in-place update, while the write is in flight
                for x in tree.leaves(state):
                    if x.is_floating_point():
                        x.add_(1.0)
    finally:
        saving.Manifest.write = write  # the ranks outlive this test
    # AsyncSaver's contract: once close() returns, on any rank, the checkpoint is committed.
    committed = sorted(os.listdir(root))
    assert committed == ["step_000000005"], f"rank {rank}: after close(), {root} holds {committed}"
    like = wan_state(rank, sharded=True, seed=1, fill=None, extra=zeros_like_state(extra))
    loaded = load(checkpoint_dir(root, 5), like=like)
    tree.assert_trees_equal(loaded, expected, check_static=False)
    return int(loaded.extra["per_rank"])


@pytest.mark.multirank
def test_async_save_on_two_ranks_captures_the_sharded_state_at_call_time(ranks, tmp_path):
    assert ranks.run(async_round_trip_on_ranks, str(tmp_path)) == [0, 1]


@pytest.mark.multirank
def test_async_save_on_two_ranks_returns_on_no_rank_before_rank_0_commits(ranks, tmp_path):
    # Rank 1 finishes its shards long before rank 0 renames the directory into place; its
    # close() must still wait for that rename (the broadcast that ends the background write).
    assert ranks.run(async_round_trip_on_ranks, str(tmp_path), 2.0) == [0, 1]


def save_sharded_on_ranks(rank: int, world_size: int, root: str, per_rank: bool):
    extra = {"per_rank": torch.tensor([rank])} if per_rank else {"shared": torch.tensor([7])}
    state = wan_state(rank, sharded=True, extra=extra)
    save(state, checkpoint_dir(root, 5))
    return full_tensors(state)


@pytest.mark.multirank
def test_saved_on_two_ranks_loads_on_one_process_leaf_exact(ranks, tmp_path):
    gathered = ranks.run(save_sharded_on_ranks, str(tmp_path), False)
    tree.assert_trees_equal(gathered[0], gathered[1])  # full tensors agree across ranks
    like = wan_state(0, sharded=False, seed=1, fill=None, extra={"shared": torch.tensor([0])})
    loaded = load(checkpoint_dir(tmp_path, 5), like=like)
    tree.assert_trees_equal(full_tensors(loaded), gathered[0])


def load_sharded_on_ranks(rank: int, world_size: int, path: str, expected):
    like = wan_state(rank, sharded=True, seed=1, fill=None, extra={"shared": torch.tensor([0])})
    loaded = load(path, like=like)
    assert any(hasattr(x, "to_local") for x in tree.leaves(loaded))
    tree.assert_trees_equal(full_tensors(loaded), expected)
    return True


@pytest.mark.multirank
def test_saved_on_one_process_loads_on_two_ranks_leaf_exact(ranks, tmp_path):
    state = wan_state(0, sharded=False, extra={"shared": torch.tensor([7])})
    path = save(state, checkpoint_dir(tmp_path, 5))
    assert ranks.run(load_sharded_on_ranks, str(path), full_tensors(state)) == [True, True]


@pytest.mark.multirank
def test_per_rank_values_refuse_another_world_size(ranks, tmp_path):
    saved = ranks.run(save_sharded_on_ranks, str(tmp_path), True)[0]
    path = checkpoint_dir(tmp_path, 5)
    like = wan_state(0, sharded=False, fill=None, extra={"per_rank": torch.tensor([0])})
    before = disk_snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"per-rank.*saved by 2 ranks.*loaded on 1") as info:
        load(path, like=like)
    assert str(path) in str(info.value) and "extra.per_rank" in str(info.value)
    assert "reset=('extra.per_rank',)" in str(info.value) and "Checkpoints(" in str(info.value)
    assert disk_snapshot(tmp_path) == before
    # start the per-rank values afresh from `like`; everything else is the checkpoint's
    loaded = load(path, like=like, reset=("extra.per_rank",))
    assert (
        int(loaded.extra["per_rank"]) == 0
        and loaded.extra["per_rank"] is not like.extra["per_rank"]
    )
    got = full_tensors(loaded)
    assert set(got) == set(saved)
    tree.assert_trees_equal(
        {p: x for p, x in got.items() if p != "extra.per_rank"},
        {p: x for p, x in saved.items() if p != "extra.per_rank"},
    )
    with pytest.raises(ValueError, match="names no leaf"):
        load(path, like=like, reset=("extra.nothing",))


def test_reset_leaves_are_copies_of_likes_and_skip_the_checks_of_the_checkpoint(tmp_path):
    """``load(reset=...)``: the reset leaves are ``like``'s values in tensors of their own (a
    step on the loaded state leaves ``like`` as it was), the rest is the checkpoint's; a
    reset frozen role saved by checksum is not checked against the checkpoint's weights;
    ``fvstep.run`` resumes with ``Checkpoints(reset=...)``."""
    from fvstep.methods import finetune
    from fvstep.methods.models import synthetic_batch, tiny_wan

    def state_of(seed: int, teacher_seed: int) -> fs.TrainState:
        return fs.TrainState.create(
            {
                "student": fs.Role(tiny_wan(seed=seed, num_layers=1), optimizer=fs.optim.adamw()),
                "teacher": fs.Role(tiny_wan(seed=teacher_seed, num_layers=1), save_frozen=False),
            },
            key=fs.random.key(seed),
            extra={"n": torch.tensor([seed])},
        )

    step = fs.compile(finetune())
    batch = synthetic_batch(fs.random.key(0), batch_size=2, frames=1)
    state, _ = step(state_of(0, 1), batch)
    path = save(state, checkpoint_dir(tmp_path / "a", 1))
    like = state_of(5, 1)
    before = tree.clone(like)
    reset = ("roles.student.opt_state", "extra.n")
    loaded = load(path, like=like, reset=reset)
    assert int(loaded.extra["n"]) == 5
    tree.assert_trees_equal(loaded.roles["student"].params, state.roles["student"].params)
    tree.assert_trees_equal(loaded.roles["student"].opt_state, before.roles["student"].opt_state)
    step(loaded, batch)  # updates the loaded leaves in place
    tree.assert_trees_equal(like, before)
    other_base = state_of(5, 2)
    with pytest.raises(CheckpointError, match="other frozen weights"):
        load(path, like=other_base)
    teacher = load(path, like=other_base, reset=("roles.teacher",)).roles["teacher"]
    tree.assert_trees_equal(teacher.params, other_base.roles["teacher"].params)
    # fs.run resumes with the same reset
    ckpts = fs.Checkpoints(tmp_path / "run", every=1, reset=("extra.n",))
    fs.run(step, state_of(0, 1), lambda i: batch, num_steps=1, checkpoints=ckpts, progress=False)
    resumed = fs.run_until(
        step, state_of(7, 1), lambda i: batch, num_steps=2, checkpoints=ckpts, progress=False
    ).state
    assert int(resumed.extra["n"]) == 7 and int(resumed.step) == 2
    with pytest.raises(ValueError, match="leaf paths"):
        fs.Checkpoints(tmp_path, reset=("",))
    assert fs.Checkpoints(tmp_path, reset="extra.n").reset == ("extra.n",)  # one path
    assert int(load(path, like=like, reset="extra.n").extra["n"]) == 5


# ------------------------------------------------------- 4. atomic commit and latest

KINDS = ["complete", "tmp", "no_manifest", "bad_json", "bad_digest", "file"]


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    """A complete checkpoint of ``small_state()`` to copy around."""
    root = tmp_path_factory.mktemp("one")
    return save(small_state(), checkpoint_dir(root, 3))


def make_entry(root: Path, step: int, kind: str, source: Path) -> None:
    final = checkpoint_dir(root, step)
    if kind == "file":
        final.write_text("not a directory")
        return
    target = directories.temp_dir(root, step) if kind == "tmp" else final
    shutil.copytree(source, target)  # a .tmp-* dir is complete apart from its name
    manifest = target / MANIFEST_NAME
    if kind == "no_manifest":
        manifest.unlink()
    elif kind == "bad_json":
        manifest.write_text(manifest.read_text()[:-40])
    elif kind == "bad_digest":
        body = json.loads(manifest.read_text())
        body["checksums"]["step"] += 1
        manifest.write_text(json.dumps(body))


entries = st.dictionaries(st.integers(0, 40), st.sampled_from(KINDS), max_size=6)


@settings(max_examples=25, deadline=None)
@given(entries=entries)
def test_latest_is_the_newest_complete_checkpoint_never_a_partial_one(one_checkpoint, entries):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for step, kind in entries.items():
            make_entry(root, step, kind, one_checkpoint)
        (root / "step_abc").mkdir()
        complete = sorted(s for s, k in entries.items() if k == "complete")
        assert [s for s, _ in list_complete(root)] == complete
        found = latest(root)
        if complete:
            assert found == checkpoint_dir(root, complete[-1])
            assert_loads_as(found, small_state(), small_state(seed=9))
        else:
            assert found is None


@settings(max_examples=25, deadline=None)
@given(entries=entries, keep=st.one_of(st.none(), st.integers(0, 4)))
def test_prune_keeps_the_newest_n_and_never_the_newest_complete(one_checkpoint, entries, keep):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for step, kind in entries.items():
            make_entry(root, step, kind, one_checkpoint)
        in_flight = directories.temp_dir(root, 99)
        shutil.copytree(one_checkpoint, in_flight)
        complete = sorted(s for s, k in entries.items() if k == "complete")
        ckpt.prune(root, keep, keep_temp=in_flight)
        kept = [s for s, _ in list_complete(root)]
        expected = complete if keep is None else complete[max(len(complete) - max(keep, 1), 0) :]
        assert kept == expected
        if complete:
            assert kept[-1] == complete[-1]  # the newest complete one survives, even keep=0
        temps = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
        assert temps == [in_flight.name]  # stale temporaries go, the save in flight stays
        for s in kept:
            assert_loads_as(checkpoint_dir(root, s), small_state(), small_state(seed=9))


def test_saving_over_an_existing_checkpoint_needs_overwrite(tmp_path):
    path = save(small_state(seed=0), checkpoint_dir(tmp_path, 3))
    before = disk_snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="already exists.*overwrite=True") as info:
        save(small_state(seed=1), path)
    assert str(path) in str(info.value)
    assert disk_snapshot(tmp_path) == before
    save(small_state(seed=1), path, overwrite=True)
    assert_loads_as(path, small_state(seed=1), small_state(seed=9))
    assert sorted(os.listdir(tmp_path)) == [path.name]


class SimulatedKill(BaseException):
    """The process died here (nothing after this point runs)."""


def rmtree_killed_midway(path, *args, **kwargs):
    """``shutil.rmtree`` killed after its first unlink. rmtree deletes in directory order,
    which the filesystem chooses; the worst case deletes the data before the manifest."""
    files = sorted(Path(path).iterdir(), key=lambda f: f.name == MANIFEST_NAME)
    files[0].unlink()
    raise SimulatedKill(f"killed while deleting {path}")


def test_a_crash_while_pruning_leaves_only_loadable_checkpoints(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        save(small_state(seed=step), checkpoint_dir(tmp_path, step))
    with monkeypatch.context() as m, contextlib.suppress(SimulatedKill):
        m.setattr(directories.shutil, "rmtree", rmtree_killed_midway)
        ckpt.prune(tmp_path, keep=1)
    assert latest(tmp_path) == checkpoint_dir(tmp_path, 3)
    for step, path in list_complete(tmp_path):
        assert_loads_as(path, small_state(seed=step), small_state(seed=9))


def test_a_crash_while_overwriting_leaves_a_loadable_latest(tmp_path, monkeypatch):
    save(small_state(seed=1), checkpoint_dir(tmp_path, 1))
    path = save(small_state(seed=2), checkpoint_dir(tmp_path, 2))
    with monkeypatch.context() as m, contextlib.suppress(SimulatedKill):
        m.setattr(saving.shutil, "rmtree", rmtree_killed_midway)
        save(small_state(seed=3), path, overwrite=True)
    found = latest(tmp_path)
    assert found is not None
    load(found, like=small_state(seed=9))  # old step 2, new step 2 or step 1: any, but whole


def test_leftovers_of_a_crashed_save_do_not_block_the_next_save(tmp_path):
    path = checkpoint_dir(tmp_path, 4)
    stale = directories.temp_dir(tmp_path, 4)
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half a shard")
    assert latest(tmp_path) is None
    save(small_state(seed=4), path)
    assert latest(tmp_path) == path and not stale.exists()
    assert_loads_as(path, small_state(seed=4), small_state(seed=9))


# ------------------------------------------------------------------ 5. crash safety


class CrashServer:
    """``tests/crash_saver.py serve``: forks a saver per trial, reports how it died."""

    def __init__(self, log: Path) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.log = log
        self._stderr = open(log, "w")  # noqa: SIM115  closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "crash_saver.py"), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("eof")

    def next_line(self, timeout: float = 120.0) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"crash_saver said nothing for {timeout} s") from None
        if line == "eof" or line.startswith("exit"):
            raise AssertionError(f"crash_saver ended ({line}): {self.log.read_text()[-2000:]}")
        return line

    def trial(self, root: Path, delay_fraction: float, span: float) -> tuple[float, list[int]]:
        """Start a saver in ``root``, kill it ``delay_fraction * span * (its save time)``
        seconds after its first checkpoint; return the delay and the steps it reported saved."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{root}\n")
        self.proc.stdin.flush()
        kind, pid, save_s = self.next_line().split()
        assert kind == "ready", kind
        delay = delay_fraction * span * float(save_s)
        time.sleep(delay)
        os.kill(int(pid), signal.SIGKILL)
        saved = []
        while not (line := self.next_line()).startswith("dead"):
            assert line.startswith("saved "), line
            saved.append(int(line.split()[1]))
        assert line == f"dead {pid} {int(signal.SIGKILL)}", line
        return delay, [1, *saved]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture(scope="module")
def crash_server(tmp_path_factory):
    if not hasattr(os, "fork"):
        pytest.skip("the crash saver forks")
    server = CrashServer(tmp_path_factory.mktemp("crash") / "stderr.txt")
    yield server
    server.close()


def check_crash_trials(server: CrashServer, workdir: Path, num_trials: int, seed: int) -> None:
    from tests.crash_saver import make_state

    rng = random.Random(seed)
    like = make_state(0)
    expected = {}
    left_temporaries = 0
    for trial in range(num_trials):
        root = workdir / f"trial{trial}"
        delay, saved = server.trial(root, rng.random(), span=3.0)
        where = f"trial {trial} (killed {delay:.3f} s after its first save)"
        found = latest(root)
        complete = list_complete(root)
        # the newest save that returned is visible; nothing newer than what was started
        assert found == checkpoint_dir(root, saved[-1]) or found == checkpoint_dir(
            root, saved[-1] + 1
        ), f"{where}: latest is {found}, saves returned: {saved}"
        assert [s for s, _ in complete][: len(saved)] == saved, f"{where}: {complete}"
        temporaries = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
        left_temporaries += bool(temporaries)
        assert not {p for _, p in complete} & set(temporaries)
        for step, path in complete:  # load re-checks every checksum
            if step not in expected:
                expected[step] = make_state(step)
            try:
                assert_loads_as(path, expected[step], like)
            except (CheckpointError, AssertionError) as e:
                raise AssertionError(f"{where}: {path.name} does not load: {e}") from e
        # and the interrupted save can be redone over its leftovers
        redo = checkpoint_dir(root, saved[-1] + 1)
        if not redo.exists():
            save(make_state(saved[-1] + 1), redo)
        shutil.rmtree(root)
    assert left_temporaries > 0, "no kill landed inside a save: the trials test nothing"


def test_a_saver_killed_at_random_points_always_leaves_a_loadable_latest(crash_server, tmp_path):
    check_crash_trials(crash_server, tmp_path, NUM_CRASH_TRIALS, seed=0)


@pytest.mark.heavy
def test_a_saver_killed_at_random_points_always_leaves_a_loadable_latest_heavy(
    crash_server, tmp_path
):
    check_crash_trials(crash_server, tmp_path, NUM_CRASH_TRIALS_HEAVY, seed=1)


# ------------------------------------------------------------------ 6. bad input


def assert_refused(
    path: Path, like, error: type[BaseException], *needles: str, root: Path | None = None
) -> str:
    """``load(path, like=like)`` raises ``error`` naming ``path`` and every needle, and
    changes nothing: no file under ``root`` (default: ``path``'s parent), not ``like``."""
    root = root or path.parent
    before = disk_snapshot(root)
    like_digest = tree.tree_digest(like)
    with pytest.raises(BaseException) as info:  # the type is checked below, with the message
        load(path, like=like)
    message = str(info.value)
    assert isinstance(info.value, error), (
        f"expected {error.__name__}, got {type(info.value).__module__}."
        f"{type(info.value).__name__}: {message[:600]}"
    )
    assert str(path) in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert disk_snapshot(root) == before, "the failed load changed files on disk"
    assert tree.tree_digest(like) == like_digest, "the failed load changed like"
    return message


@pytest.fixture
def saved(tmp_path) -> Path:
    return save(small_state(), checkpoint_dir(tmp_path, 3))


def test_a_missing_directory_is_a_file_not_found_error(tmp_path):
    assert_refused(tmp_path / "nowhere", small_state(), FileNotFoundError)


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "model.safetensors").write_bytes(b"\0" * 64)
    assert_refused(tmp_path / "notes", small_state(), CheckpointError, "not an fvstep checkpoint")


def test_a_truncated_shard_is_refused(saved):
    shard = shard_files(saved)[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert_refused(saved, small_state(seed=9), CheckpointError)


def test_a_deleted_shard_is_refused(saved):
    shard_files(saved)[0].unlink()
    assert_refused(saved, small_state(seed=9), CheckpointError)


def test_changed_shard_content_fails_the_checksum_naming_the_leaf(saved):
    leaf = "roles.student.opt_state.exp_avg.0.weight"
    corrupt_leaf_bytes(saved, leaf, small_state().roles["student"].opt_state.exp_avg["0.weight"])
    assert_refused(saved, small_state(seed=9), CheckpointError, f"'{leaf}'", "checksum")


def test_an_edited_manifest_fails_its_own_digest(saved):
    manifest = saved / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    body["checksums"]["roles.student.params.0.weight"] += 1
    manifest.write_text(json.dumps(body))
    assert_refused(saved, small_state(), CheckpointError, "digest")


def test_a_like_whose_optimizer_state_does_not_fit_its_parameters_is_refused(tmp_path):
    # update() no longer re-checks the moments' shapes on every call (a (1,) moment would
    # broadcast silently in torch's kernels): load checks them once. Checkpoint and
    # `like` agree with each other here; only the moments and parameters disagree.
    def misfit(seed: int) -> fs.TrainState:
        state = small_state(seed=seed)
        state.roles["student"].opt_state.exp_avg["0.weight"] = torch.zeros(1)
        return state

    path = save(misfit(0), checkpoint_dir(tmp_path, 3))
    message = assert_refused(path, misfit(9), CheckpointError, "'student'", "does not fit")
    assert "0.weight" in message


def test_a_role_added_since_the_save_is_named(saved):
    message = assert_refused(saved, small_state(critic=True), CheckpointError, "'critic'")
    assert "roles added" in message


def test_a_role_removed_since_the_save_is_named(saved):
    message = assert_refused(saved, small_state(teacher=False), CheckpointError, "'teacher'")
    assert "roles removed" in message


def test_a_shape_change_names_the_leaf(saved):
    assert_refused(
        saved, small_state(width=5), CheckpointError, "'roles.student.params.0.weight'", "(8, 5)"
    )


def test_a_dtype_change_names_the_leaf(saved):
    like = small_state(teacher_dtype=torch.bfloat16)
    assert_refused(saved, like, CheckpointError, "'roles.teacher.params", "bfloat16")


def test_a_newer_format_version_is_refused(saved):
    manifest = saved / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    body["format_version"] = FORMAT_VERSION + 1  # the digest covers the checksums only
    manifest.write_text(json.dumps(body))
    assert_refused(saved, small_state(), CheckpointError, "format version", "upgrade fvstep")


def test_a_directory_of_checkpoints_is_refused_with_a_hint_to_use_latest(saved):
    root = saved.parent
    save(small_state(seed=1), checkpoint_dir(root, 4))
    assert_refused(root, small_state(), CheckpointError, "latest", root=root)


# ------------------------------------------------------------------------- 7. async


def bump_in_place(state) -> None:
    with torch.no_grad():
        for x in tree.leaves(state):
            if x.dtype == torch.bool:
                x.logical_not_()
            else:
                x.add_(1)


@settings(max_examples=6, deadline=None)
@given(state=train_states(max_roles=2))
def test_async_save_captures_the_state_at_call_time(state):
    at_call = tree.clone(state)
    with tempfile.TemporaryDirectory() as tmp, ckpt.AsyncSaver() as saver:
        path = checkpoint_dir(tmp, 1)
        saver.save(state, path)
        bump_in_place(state)  # the step that follows the save updates in place at once
        saver.wait()
        loaded = load(path, like=zeros_like_state(state))
    tree.assert_trees_equal(loaded, at_call)


def fail_commit(*args, **kwargs):
    raise OSError("disk full while committing")


@pytest.mark.parametrize("surfaces_at", ["wait", "save", "close"])
def test_a_background_failure_surfaces_at_the_next_call(tmp_path, monkeypatch, surfaces_at):
    state = small_state()
    saver = ckpt.AsyncSaver()
    try:
        with monkeypatch.context() as m:
            m.setattr(saving.Manifest, "write", fail_commit)  # rank 0's commit
            saver.save(state, checkpoint_dir(tmp_path, 1))
            with pytest.raises(CheckpointError, match="disk full while committing") as info:
                if surfaces_at == "wait":
                    saver.wait()
                elif surfaces_at == "save":
                    saver.save(state, checkpoint_dir(tmp_path, 2))
                else:
                    saver.close()
        assert str(checkpoint_dir(tmp_path, 1)) in str(info.value)
        assert latest(tmp_path) is None and list_complete(tmp_path) == []
        assert not checkpoint_dir(tmp_path, 1).exists()
        assert not checkpoint_dir(tmp_path, 2).exists()
        assert not list(tmp_path.glob(".tmp-*"))  # the failed save cleaned up after itself
        if surfaces_at != "close":  # the error was reported once; the saver works again
            saver.save(state, checkpoint_dir(tmp_path, 3))
            saver.wait()
            assert latest(tmp_path) == checkpoint_dir(tmp_path, 3)
            assert_loads_as(latest(tmp_path), state, small_state(seed=9))
    finally:
        with contextlib.suppress(OSError):
            saver.close()


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int64, torch.float32, torch.bfloat16, torch.bool]
)
def test_checksums_never_modify_the_leaves(dtype):
    from fvstep.checkpoint.saving import leaf_checksum

    x = (torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    before = x.clone()
    first = leaf_checksum(x)
    assert torch.equal(x, before)
    assert torch.equal(leaf_checksum(x), first)
    x.view(-1)[7] = ~before.view(-1)[7] if dtype == torch.bool else before.view(-1)[7] + 1
    assert not torch.equal(x, before)
    assert not torch.equal(leaf_checksum(x), first)  # one changed element changes the sum


@pytest.mark.parametrize("writer_threads", [1, 3])
def test_a_save_on_several_writer_threads_writes_that_many_files_and_loads_leaf_exact(
    tmp_path, writer_threads
):
    state = small_state(critic=True)
    path = ckpt.save(state, tmp_path / "c", writer_threads=writer_threads)
    assert len(shard_files(path)) == writer_threads
    tree.assert_trees_equal(ckpt.load(path, like=zeros_like_state(state)), state)
    with ckpt.AsyncSaver() as saver:
        saver.save(state, tmp_path / "a", writer_threads=writer_threads)
    assert len(shard_files(tmp_path / "a")) == writer_threads
    tree.assert_trees_equal(ckpt.load(tmp_path / "a", like=zeros_like_state(state)), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("writer_threads", [1, 4])
def test_a_state_on_the_gpu_saved_on_several_threads_loads_leaf_exact(tmp_path, writer_threads):
    # several threads: DCP copies each tensor to the host on the thread that writes it
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "w": torch.randn(4096, 513, device="cuda", generator=g),
        "h": torch.randn(77, device="cuda", generator=g).to(torch.bfloat16),
        "n": torch.arange(5, device="cuda"),
    }
    path = ckpt.save(state, tmp_path / "c", writer_threads=writer_threads)
    assert len(shard_files(path)) == writer_threads
    back = ckpt.load(path, like={k: torch.zeros_like(v) for k, v in state.items()})
    for k, v in state.items():
        assert back[k].device == v.device and torch.equal(back[k], v), k


@pytest.mark.parametrize(
    ("bad", "error", "says"),
    [(0, ValueError, "writer_threads must be >= 1"), (2.5, TypeError, "must be an integer")],
)
def test_a_bad_writer_thread_count_is_refused_before_anything_is_written(
    tmp_path, bad, error, says
):
    with pytest.raises(error, match=says):
        ckpt.save(small_state(), tmp_path / "c", writer_threads=bad)
    with ckpt.AsyncSaver() as saver, pytest.raises(error, match=says):
        saver.save(small_state(), tmp_path / "c", writer_threads=bad)
    assert list(tmp_path.iterdir()) == []
