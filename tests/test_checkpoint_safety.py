"""Checkpoints never hold, or give back, a wrong value; every failure names its path.

1. Non-finite states: ``save`` (and ``AsyncSaver.save``) refuse a NaN or Inf in any
   floating-point leaf, naming the first such leaf and the step, unless
   ``allow_nonfinite=True``; on two ranks a NaN in one rank's shard makes both refuse.
   The check is folded into the checksum pass (``local_checks``).
2. Malformed manifests: whatever is done to a valid manifest (keys dropped, types
   changed, random bytes), ``read_manifest``/``load``/``list_complete`` raise nothing
   but ``CheckpointError``, and a load that succeeds gives the saved state bitwise.
3. Failed writes (a full disk, a read-only or impossible target): a ``CheckpointError``
   naming the target and the cause, on every rank, and no ``.tmp-*`` left behind.
4. A value damaged on one rank only is refused by every rank.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.futures import Future

from fvstep import checkpoint as ckpt
from fvstep.checkpoint import (
    CheckpointError,
    DamagedCheckpointError,
    checkpoint_dir,
    list_complete,
    load,
    save,
    saving,
)
from fvstep.checkpoint.saving import MANIFEST_NAME, Manifest, NewerFormatError, read_manifest
from fvstep.core import tree
from tests.test_checkpoint import (
    corrupt_leaf_bytes,
    disk_snapshot,
    small_state,
    wan_state,
)

# ------------------------------------------------------------ 1. non-finite states

NONFINITE_LEAVES = {
    "param": lambda s: s.roles["student"].params["0.weight"],
    "adam_moment": lambda s: s.roles["student"].opt_state.exp_avg_sq["1.bias"],
    "ema": lambda s: s.roles["student"].ema.params["1.weight"],
    "frozen_bf16": lambda s: s.roles["teacher"].params["0.bias"],
    "extra": lambda s: s.extra["cache"][0],
}


def leaf_path(state, leaf: torch.Tensor) -> str:
    paths, leaves, _ = tree.flatten_with_paths(state)
    return next(p for p, x in zip(paths, leaves) if x is leaf)


def poison(state, which: str, value: float) -> str:
    """Put ``value`` into one element of a leaf; return the leaf's path."""
    leaf = NONFINITE_LEAVES[which](state)
    with torch.no_grad():
        leaf.view(-1)[-1] = value
    return leaf_path(state, leaf)


def assert_nothing_saved(root: Path) -> None:
    assert list_complete(root) == []
    assert not list(root.glob(".tmp-*")), sorted(os.listdir(root))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", sorted(NONFINITE_LEAVES))
def test_save_refuses_a_nonfinite_leaf_naming_it_and_the_step(tmp_path, which, value):
    state = small_state(teacher_dtype=torch.bfloat16)
    leaf = poison(state, which, value)
    path = checkpoint_dir(tmp_path, 3)
    with pytest.raises(CheckpointError) as info:
        save(state, path)
    message = str(info.value)
    assert f"'{leaf}'" in message and "NaN or Inf" in message and "step 3" in message, message
    assert str(path) in message and "allow_nonfinite=True" in message
    assert_nothing_saved(tmp_path)


def test_save_names_the_first_nonfinite_leaf_in_path_order(tmp_path):
    state = small_state()
    later = poison(state, "extra", math.nan)
    first = poison(state, "param", math.inf)
    paths = tree.flatten_with_paths(state)[0]
    assert paths.index(first) < paths.index(later)
    with pytest.raises(CheckpointError, match=f"'{first}'"):
        save(state, checkpoint_dir(tmp_path, 3))


def test_allow_nonfinite_saves_the_state_bitwise(tmp_path):
    state = small_state()
    poison(state, "param", math.nan)
    poison(state, "adam_moment", -math.inf)
    path = save(state, checkpoint_dir(tmp_path, 3), allow_nonfinite=True)
    tree.assert_trees_equal(load(path, like=small_state(seed=9)), state, check_static=False)


def test_async_save_refuses_a_nonfinite_leaf(tmp_path):
    state = small_state()
    leaf = poison(state, "ema", math.nan)
    with ckpt.AsyncSaver() as saver:
        # On a CPU the check runs with the background checksums: the next call raises.
        with pytest.raises(CheckpointError, match=f"'{leaf}'.*step 3"):
            saver.save(state, checkpoint_dir(tmp_path, 3))
            saver.wait()
        assert_nothing_saved(tmp_path)
        saver.save(state, checkpoint_dir(tmp_path, 3), allow_nonfinite=True)
    assert [s for s, _ in list_complete(tmp_path)] == [3]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
def test_the_finiteness_check_rides_on_the_checksum_pass(monkeypatch, dtype):
    """``local_checks`` gives ``leaf_checksum``'s sums and a correct finiteness flag, also
    when the bad element lies in a later chunk of the pass."""
    monkeypatch.setattr(saving, "_CPU_CHUNK", 64)
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(300, generator=gen).to(dtype)
    leaves = [clean, torch.arange(10), torch.ones(3, dtype=torch.bool), torch.empty(0)]
    for position in (0, 63, 64, 299):
        for bad in (math.nan, math.inf):
            if dtype == torch.float8_e4m3fn and bad == math.inf:
                continue  # e4m3fn has no infinity (it saturates to 448)
            dirty = clean.clone()
            dirty[position] = bad
            sums, finite = saving.local_checks([*leaves, dirty])
            assert finite == [True, True, True, True, False], (position, bad)
            assert [int(v) for v in sums] == [
                int(saving.leaf_checksum(x)) for x in [*leaves, dirty]
            ]
    assert saving.local_checks([clean], check_finite=False)[1] == [True]


def _reference_checksum(x: torch.Tensor, start: int = 0) -> int:
    """The documented checksum in one piece, in Python ints: the chunked pass must equal it."""
    k1, k2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    raw = x.reshape(-1).view(ints[x.element_size()]).tolist()
    mask, total = (1 << 64) - 1, 0
    for i, bits in enumerate(raw):
        h = (((bits & mask) ^ ((start + i) * k2)) * k1) & mask
        h = h - (1 << 64) if h >> 63 else h  # the arithmetic shift of an int64
        total += (h ^ (h >> 32)) & mask
    total &= mask
    return total - (1 << 64) if total >> 63 else total


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8]
)
@pytest.mark.parametrize("threads", [1, 4])
def test_the_chunked_checksum_equals_the_formula(monkeypatch, dtype, threads):
    """The pass reuses its buffers and advances the index chunk by chunk (a leaf of 3 chunks
    and a partial one, a shard starting at a nonzero row), on one thread or cut into
    segments summed by several: the sums are the formula's."""
    monkeypatch.setattr(saving, "_CPU_CHUNK", 64 if threads == 1 else 8)
    monkeypatch.setattr(saving, "_SEGMENT_CHUNKS", 2)
    monkeypatch.setattr(saving, "_threads", lambda: threads)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 30, generator=gen) * 50).to(dtype)
    assert int(saving.leaf_checksum(x)) == _reference_checksum(x)
    flat = x.reshape(-1)
    start = 2**40 + 3
    assert int(saving._rows_checks(flat, start, check_finite=False)[0]) == _reference_checksum(
        flat, start
    )
    one_off = x.clone().reshape(-1)
    one_off[130] = one_off[131] if one_off[130] != one_off[131] else one_off[130] + 1
    assert int(saving.leaf_checksum(one_off)) != _reference_checksum(x)


def save_nonfinite_on_ranks(rank: int, world_size: int, root: str, kind: str, mode: str):
    extra = {"per_rank": torch.full((4,), float(rank))}
    state = wan_state(rank, sharded=True, extra=extra)
    if rank == 1:  # only rank 1 holds the bad value
        with torch.no_grad():
            if kind == "shard":
                target = state.roles["student"].opt_state.exp_avg
                name = sorted(target)[0]
                target[name].to_local().view(-1)[0] = float("nan")
            else:
                state.extra["per_rank"][2] = float("inf")
    path = checkpoint_dir(root, 5)
    try:
        if mode == "sync":
            save(state, path)
        else:
            with ckpt.AsyncSaver() as saver:
                saver.save(state, path)
    except CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", ["shard", "per_rank"])
def test_a_nonfinite_value_on_one_rank_makes_every_rank_refuse(ranks, tmp_path, kind, mode):
    messages = ranks.run(save_nonfinite_on_ranks, str(tmp_path), kind, mode)
    assert messages[0] == messages[1] != "saved", messages
    assert "NaN or Inf on rank 1 at step 5" in messages[0]
    leaf = "roles.student.opt_state.exp_avg." if kind == "shard" else "extra.per_rank"
    assert f"'{leaf}" in messages[0], messages[0]
    assert_nothing_saved(tmp_path)


# ----------------------------------------------------------- 2. malformed manifests


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory) -> Path:
    return save(small_state(), checkpoint_dir(tmp_path_factory.mktemp("saved"), 3))


def manifest_body(path: Path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_text())


def with_body(saved: Path, root: Path, body: dict | bytes) -> Path:
    """A copy of the checkpoint ``saved`` under ``root`` with ``body`` as its manifest."""
    path = checkpoint_dir(root, 3)
    shutil.copytree(saved, path)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    (path / MANIFEST_NAME).write_bytes(raw)
    return path


def first_leaf(body: dict) -> str:
    return sorted(body["leaves"])[0]


MALFORMED = {
    "not_utf8": lambda b: b"\xff\xfe" + json.dumps(b).encode(),
    "no_format_version": lambda b: {k: v for k, v in b.items() if k != "format_version"},
    "format_version_str": lambda b: {**b, "format_version": "1"},
    "format_version_bool": lambda b: {**b, "format_version": True},
    "format_version_zero": lambda b: {**b, "format_version": 0},
    "no_leaves": lambda b: {k: v for k, v in b.items() if k != "leaves"},
    "leaves_a_list": lambda b: {**b, "leaves": list(b["leaves"])},
    "leaf_without_dtype": lambda b: drop_leaf_field(b, "dtype"),
    "leaf_without_shape": lambda b: drop_leaf_field(b, "shape"),
    "leaf_without_sharded": lambda b: drop_leaf_field(b, "sharded"),
    "leaf_without_per_rank": lambda b: drop_leaf_field(b, "per_rank"),
    "leaf_shape_str": lambda b: set_leaf_field(b, "shape", "8x4"),
    "leaf_dtype_int": lambda b: set_leaf_field(b, "dtype", 32),
    "step_str": lambda b: {**b, "step": "3"},
    "world_size_zero": lambda b: {**b, "world_size": 0},
    "leaf_without_checksum": lambda b: {
        **b,
        "leaves": {**b["leaves"], "roles.extra_leaf": b["leaves"][first_leaf(b)]},
    },
    "digest_int": lambda b: {**b, "digest": 7},
    "a_json_list": lambda b: [b],
}


def drop_leaf_field(body: dict, field: str) -> dict:
    name = first_leaf(body)
    entry = {k: v for k, v in body["leaves"][name].items() if k != field}
    return {**body, "leaves": {**body["leaves"], name: entry}}


def set_leaf_field(body: dict, field: str, value) -> dict:
    name = first_leaf(body)
    return {**body, "leaves": {**body["leaves"], name: {**body["leaves"][name], field: value}}}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_is_a_checkpoint_error_naming_the_file(saved_dir, tmp_path, case):
    path = with_body(saved_dir, tmp_path, MALFORMED[case](manifest_body(saved_dir)))
    with pytest.raises(DamagedCheckpointError) as info:
        read_manifest(path)
    message = str(info.value)
    assert str(path) in message, message
    assert "newer" not in message and "upgrade" not in message, message  # not "newer"
    with pytest.raises(DamagedCheckpointError):
        load(path, like=small_state())
    assert list_complete(tmp_path) == []  # never listed, so never "latest"


def test_a_missing_format_version_says_what_is_missing(saved_dir, tmp_path):
    path = with_body(saved_dir, tmp_path, MALFORMED["no_format_version"](manifest_body(saved_dir)))
    with pytest.raises(CheckpointError, match="malformed: it has no 'format_version'"):
        read_manifest(path)


def test_a_leaf_without_a_field_names_the_leaf_and_the_field(saved_dir, tmp_path):
    body = manifest_body(saved_dir)
    path = with_body(saved_dir, tmp_path, drop_leaf_field(body, "dtype"))
    with pytest.raises(CheckpointError, match=rf"leaves\['{first_leaf(body)}'\] has no 'dtype'"):
        read_manifest(path)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def json_paths(value, prefix=()) -> list[tuple]:
    """Every path (keys and indices) into a JSON value, the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += json_paths(v, (*prefix, i))
    return out


def mutate(body, path: tuple, how: str, new_value):
    if not path:
        return new_value
    head, *rest = path
    copy = dict(body) if isinstance(body, dict) else list(body)
    if not rest and how == "drop":
        del copy[head]
    else:
        copy[head] = new_value if not rest else mutate(body[head], tuple(rest), how, new_value)
    return copy


@st.composite
def mutated_manifests(draw, text: str) -> bytes:
    body = json.loads(text)
    kind = draw(st.sampled_from(["drop", "replace", "bytes", "splice", "truncate"]))
    if kind in ("drop", "replace"):
        paths = [p for p in json_paths(body) if p or kind == "replace"]
        path = draw(st.sampled_from(paths))
        return json.dumps(mutate(body, path, kind, draw(json_values))).encode()
    raw = text.encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "truncate":
        return raw[: draw(st.integers(0, len(raw)))]
    at = draw(st.integers(0, len(raw)))
    return raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at + 1 :]


@pytest.fixture(scope="module")
def mutable_copy(saved_dir, tmp_path_factory) -> Path:
    """One copy of the checkpoint whose manifest the examples overwrite (load reads only)."""
    path = checkpoint_dir(tmp_path_factory.mktemp("mutable"), 3)
    shutil.copytree(saved_dir, path)
    return path


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_mutated_manifest_gives_a_checkpoint_error_or_the_saved_state(
    saved_dir, mutable_copy, data
):
    raw = data.draw(mutated_manifests((saved_dir / MANIFEST_NAME).read_text()))
    (mutable_copy / MANIFEST_NAME).write_bytes(raw)
    manifest, listable = None, True
    try:
        manifest = read_manifest(mutable_copy)
    except NewerFormatError:
        pass  # listed, so that an older fvstep never resumes from an older step
    except CheckpointError:
        listable = False
    listed = [p for _, p in list_complete(mutable_copy.parent)]
    assert listed == ([mutable_copy] if listable else []), listed
    try:
        loaded = load(mutable_copy, like=small_state(seed=9))
    except CheckpointError:
        return
    assert isinstance(manifest, Manifest)
    tree.assert_trees_equal(loaded, small_state(), check_static=False)  # never a wrong value


def test_a_missing_directory_is_still_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path / "nowhere")
    assert list_complete(tmp_path / "nowhere") == []


# ------------------------------------------------------------ 3. failed writes

ENOSPC = "No space left on device"


def failing_stream(code: int):
    """DCP's file stream, failing with ``code`` after writing a little (as a full disk does)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with Path(path).open(mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as stream:
            stream.write(b"half a shard")
            raise OSError(code, os.strerror(code), str(path))
            yield stream  # pragma: no cover - a generator for contextmanager

    return create_stream


def failing_dcp_save(state_dict, *, checkpoint_id, **kwargs):
    (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
    raise OSError(errno.ENOSPC, ENOSPC)


def failing_manifest_write(self, directory):
    (Path(directory) / MANIFEST_NAME).write_text('{"format": "fvstep-che')
    raise OSError(errno.ENOSPC, ENOSPC)


def install_failure(m: pytest.MonkeyPatch, where: str, code: int = errno.ENOSPC) -> None:
    if where == "dcp_save":
        m.setattr(saving.dcp, "save", failing_dcp_save)
    elif where == "shard_file":
        m.setattr(dcp_filesystem.FileSystem, "create_stream", failing_stream(code))
    else:
        m.setattr(Manifest, "write", failing_manifest_write)


def lossy_write_data(original):
    """DCP's write, losing one file's failure as its helper threads do: the failure passes
    through the file's stream, is swallowed, and that file's results are missing."""

    def write_data(self, plan, planner):
        written = original(self, plan, planner)
        try:
            with self.fs.create_stream(Path(self.path) / "__0_9.distcp", "wb"):
                raise OSError(errno.ENOSPC, ENOSPC)
        except OSError:
            pass
        lost = Future()
        lost.set_result(written.wait()[:-1])
        return lost

    return write_data


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_write_lost_on_a_writer_thread_is_refused_naming_its_cause(tmp_path, monkeypatch, mode):
    older = save(small_state(seed=1), checkpoint_dir(tmp_path, 1))
    before = disk_snapshot(tmp_path)
    path = checkpoint_dir(tmp_path, 3)
    writer = saving.FileSystemWriter
    with monkeypatch.context() as m:
        m.setattr(writer, "write_data", lossy_write_data(writer.write_data))
        with pytest.raises(CheckpointError) as info:
            if mode == "sync":
                save(small_state(), path, writer_threads=2)
            else:
                with ckpt.AsyncSaver() as saver:
                    saver.save(small_state(), path, writer_threads=2)
    message = str(info.value)
    assert str(path) in message and "1 of" in message and ENOSPC in message, message
    assert disk_snapshot(tmp_path) == before
    assert [p for _, p in list_complete(tmp_path)] == [older]


def save_with(mode: str, state, path: Path) -> None:
    if mode == "sync":
        save(state, path)
        return
    with ckpt.AsyncSaver() as saver:
        saver.save(state, path)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("where", ["dcp_save", "shard_file", "manifest"])
def test_a_full_disk_names_the_checkpoint_and_the_cause_and_cleans_up(
    tmp_path, monkeypatch, where, mode
):
    older = save(small_state(seed=1), checkpoint_dir(tmp_path, 1))
    before = disk_snapshot(tmp_path)
    path = checkpoint_dir(tmp_path, 3)
    with monkeypatch.context() as m:
        install_failure(m, where)
        with pytest.raises(CheckpointError) as info:
            save_with(mode, small_state(), path)
    message = str(info.value)
    assert str(path) in message and ENOSPC in message, message
    assert "Traceback" not in message, message  # the cause, not DCP's tracebacks
    assert disk_snapshot(tmp_path) == before  # no .tmp-* left, the older one untouched
    assert [p for _, p in list_complete(tmp_path)] == [older]
    save_with(mode, small_state(), path)  # and the next save works
    tree.assert_trees_equal(load(path, like=small_state(seed=9)), small_state(), check_static=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_read_only_filesystem_names_the_checkpoint_and_the_cause(tmp_path, monkeypatch, mode):
    path = checkpoint_dir(tmp_path, 3)
    with monkeypatch.context() as m:
        install_failure(m, "shard_file", errno.EROFS)
        with pytest.raises(CheckpointError, match="Read-only file system") as info:
            save_with(mode, small_state(), path)
    assert str(path) in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_target_under_a_file_names_the_checkpoint_and_the_cause(tmp_path, mode):
    (tmp_path / "runs").write_text("a file where a directory should be")
    path = checkpoint_dir(tmp_path / "runs", 3)
    with pytest.raises(CheckpointError, match="Not a directory") as info:
        save_with(mode, small_state(), path)
    assert str(path) in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["runs"]


def test_a_read_only_directory_names_the_checkpoint(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("chmod does not stop this user (root) from writing")
        with pytest.raises(CheckpointError, match="Permission denied") as info:
            save(small_state(), checkpoint_dir(root, 3))
        assert str(checkpoint_dir(root, 3)) in str(info.value)
        assert os.listdir(root) == []
    finally:
        root.chmod(0o755)


def save_failing_on_one_rank(rank: int, world_size: int, root: str, where: str):
    state = wan_state(rank, sharded=True, extra={"per_rank": torch.tensor([rank])})
    if where == "under_a_file":  # rank 0 alone makes the temporary directory
        path = checkpoint_dir(Path(root, "runs"), 5)
        if rank == 0:
            Path(root, "runs").write_text("a file where a directory should be")
        torch.distributed.barrier()
    else:
        path = checkpoint_dir(root, 5)
    with pytest.MonkeyPatch.context() as m:
        if where == "shard_file" and rank == 1:
            install_failure(m, "shard_file")
        elif where == "manifest" and rank == 0:  # rank 0 alone commits
            install_failure(m, "manifest")
        try:
            save(state, path)
        except CheckpointError as e:
            return str(path), str(e)
    return str(path), "saved"


@pytest.mark.multirank
@pytest.mark.parametrize(
    "where, cause",
    [("shard_file", ENOSPC), ("manifest", ENOSPC), ("under_a_file", "Not a directory")],
)
def test_a_write_failure_on_one_rank_makes_every_rank_raise_and_cleans_up(
    ranks, tmp_path, where, cause
):
    results = ranks.run(save_failing_on_one_rank, str(tmp_path), where)
    for path, message in results:
        assert path in message and cause in message, results
    assert_nothing_saved(tmp_path)


# ----------------------------------------------- 4. damage on one rank, refused by all


def load_damaged_per_rank_value(rank: int, world_size: int, root: str):
    state = wan_state(rank, sharded=True, extra={"per_rank": torch.zeros(8)})
    value = torch.arange(8.0) + 100.0 * rank  # set after wan_state, which fills float leaves
    state.extra["per_rank"].copy_(value)
    path = save(state, checkpoint_dir(root, 5))
    assert "extra.per_rank" in read_manifest(path).per_rank
    torch.distributed.barrier()
    if rank == 1:
        corrupt_leaf_bytes(path, "extra.per_rank", value)
    torch.distributed.barrier()
    like = wan_state(rank, sharded=True, fill=None, extra={"per_rank": torch.zeros(8)})
    try:
        loaded = load(path, like=like)
    except DamagedCheckpointError as e:
        return str(e)
    return float(loaded.extra["per_rank"][0])


@pytest.mark.multirank
def test_a_per_rank_value_damaged_on_one_rank_is_refused_by_every_rank(ranks, tmp_path):
    results = ranks.run(load_damaged_per_rank_value, str(tmp_path))
    assert all(isinstance(r, str) for r in results), results  # rank 0 must not go on alone
    assert all("'extra.per_rank'" in r and "checksum" in r for r in results), results


def test_dcp_failures_are_reported_without_tracebacks(tmp_path):
    path = save(small_state(), checkpoint_dir(tmp_path, 3))
    for f in path.glob("*.distcp"):
        f.unlink()
    with pytest.raises(DamagedCheckpointError) as info:
        load(path, like=small_state())
    message = str(info.value)
    assert "rank 0: " in message and "tuple" not in message and "Traceback" not in message


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_checks_finiteness_without_waiting_on_the_parents_threads():
    """The CPU pass checks NaN and infinity in its own numpy reads: nothing in it runs
    torch's intra-op (OpenMP) threads, which a child forked after the parent used them
    waits on forever (``aminmax`` of a large leaf hung there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the tests run on one intra-op thread: here, the parent's pool
    x = torch.randn(2**18 * 5 + 11)  # several segments: the checksum threads run
    leaves = [x, x.to(torch.bfloat16), x.double()] * 2
    leaves[1][5] = math.inf
    expected = saving.local_checks(leaves)
    pid = os.fork()
    if pid == 0:  # the child: exit at once, whatever happens; a hang ends by SIGALRM
        code = 1
        try:
            signal.alarm(30)
            saving.local_sums(leaves)  # the child's own checksum threads start
            sums, finite = saving.local_checks(leaves)
            same = [int(v) for v in sums] == [int(v) for v in expected[0]]
            code = 0 if same and finite == expected[1] else 1
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(before)
    assert expected[1] == [True, False, True] * 2
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_the_checksum_threads_work_in_a_forked_child(monkeypatch):
    """A child forked after the checksum pool started has none of its threads: it starts
    its own instead of waiting forever on the inherited one."""
    monkeypatch.setattr(saving, "_CPU_CHUNK", 8)
    monkeypatch.setattr(saving, "_SEGMENT_CHUNKS", 2)
    monkeypatch.setattr(saving, "_threads", lambda: 2)
    x = torch.randn(400)
    expected = int(saving.leaf_checksum(x))
    assert saving._POOL is not None
    pid = os.fork()
    if pid == 0:  # the child: exit at once, whatever happens; a hang ends by SIGALRM
        code = 1
        try:
            signal.alarm(30)
            code = 0 if int(saving.leaf_checksum(x)) == expected else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
