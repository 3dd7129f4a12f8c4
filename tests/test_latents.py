"""Laws of fvstep.executor.latents' format, shape buckets and worker loader (encoding: test_latents_encode)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fvstep as fs
from fvstep.core import random as fr
from fvstep.executor.data import ShuffledSource
from fvstep.executor.latents import (
    BucketedOrder,
    LatentDataset,
    ShardError,
    WorkerSource,
    describe_shard,
    latent_source,
    read_index,
    shard_name,
    write_dataset,
    write_shard,
)
from fvstep.testing import assert_resume_exact

SHAPES = [(2, 1, 2, 2), (2, 3, 2, 2), (2, 1, 4, 2)]


def item(i: int, shape=(2, 1, 2, 2)) -> dict:
    """Item ``i``: random bytes unique to it (so a damaged row can be found in its file)."""
    g = torch.Generator().manual_seed(1000 + i)
    return {
        "latents": torch.randn(shape, generator=g),
        "text": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "caption": f"clip {i}",
        "index": i,
    }


def make_dataset(root, num: int, *, num_shapes: int = 1, shard_size: int = 5) -> list[dict]:
    items = [item(i, SHAPES[i % num_shapes]) for i in range(num)]
    write_dataset(root, [items[k : k + shard_size] for k in range(0, num, shard_size)])
    return items


def assert_batches_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
        else:
            assert a[name] == b[name], name


# ------------------------------------------------------------------------------- format


tensors = st.builds(
    lambda shape, dtype, seed: (
        torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100
    ).to(dtype),
    st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]),
    st.integers(0, 2**31),
)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.tuples(tensors, st.text(max_size=8), st.integers(-(2**40), 2**40)),
        min_size=1,
        max_size=4,
    )
)
def test_shard_round_trip_is_bitwise(tmp_path_factory, rows):
    root = tmp_path_factory.mktemp("shard")
    written = [{"x": x, "caption": c, "n": n} for x, c, n in rows]
    info = write_dataset(root, [written])[0]
    assert info.row_shapes() == [{"x": tuple(r["x"].shape)} for r in written]
    ds = LatentDataset(root)
    assert len(ds) == len(written)
    for i, expected in enumerate(written):
        assert_batches_equal(ds[i], expected)


def test_a_shard_is_readable_without_fvstep(tmp_path):
    import pyarrow.parquet as pq

    items = make_dataset(tmp_path, 3, shard_size=3)
    row = pq.ParquetFile(tmp_path / shard_name(0)).read_row_group(1).to_pylist()[0]
    dtype = getattr(torch, row["text_dtype"])
    text = torch.frombuffer(bytearray(row["text"]), dtype=dtype).reshape(row["text_shape"])
    assert torch.equal(text, items[1]["text"]) and row["caption"] == "clip 1"


def test_index_and_describe_shard_agree_on_shapes(tmp_path):
    make_dataset(tmp_path, 7, num_shapes=3, shard_size=4)
    index = read_index(tmp_path)
    assert [s.num_rows for s in index] == [4, 3]
    assert index == [describe_shard(tmp_path / shard_name(k)) for k in range(2)]
    ds = LatentDataset(tmp_path)
    assert [s["latents"] for s in ds.shapes] == [SHAPES[i % 3] for i in range(7)]
    assert ds.locate(5) == (tmp_path / shard_name(1), 1)


def test_no_index_means_an_unfinished_dataset(tmp_path):
    write_shard(tmp_path / shard_name(0), [item(0)])
    with pytest.raises(FileNotFoundError, match="encode has not finished"):
        LatentDataset(tmp_path)


def _flip_row(root, index: int, items: list[dict]) -> tuple[str, int]:
    """Flip one byte inside item ``index``'s latents on disk; return (shard path, row)."""
    ds = LatentDataset(root)
    path, row = ds.locate(index)
    data = bytearray(path.read_bytes())
    at = data.find(items[index]["latents"].numpy().tobytes())
    assert at >= 0
    data[at + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    return str(path), row


def test_a_damaged_row_is_an_error_naming_file_and_row(tmp_path):
    items = make_dataset(tmp_path, 8, shard_size=4)
    path, row = _flip_row(tmp_path, 6, items)
    ds = LatentDataset(tmp_path)
    assert_batches_equal(ds[5], items[5])  # the other rows of the shard still read
    with pytest.raises(ShardError, match=rf"damaged shard '{path}', row {row} \(item 6\)"):
        ds[6]


def test_a_truncated_or_missing_shard_is_an_error_naming_it(tmp_path):
    make_dataset(tmp_path, 8, shard_size=4)
    shard = tmp_path / shard_name(1)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ShardError, match=rf"damaged shard '{shard}'.*row 2, item 6"):
        LatentDataset(tmp_path)[6]
    shard.unlink()
    with pytest.raises(ShardError, match=rf"missing shard '{shard}'"):
        LatentDataset(tmp_path)


# ------------------------------------------------------------------------ shape buckets


@st.composite
def bucket_layouts(draw):
    """(shapes of the items, batch_size, world_size, drop_last), some bucket fitting."""
    world = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(0, 12), min_size=1, max_size=3))
    sizes[0] = max(sizes[0], batch * world)
    shapes = [(b,) for b, n in enumerate(sizes) for _ in range(n)]
    shapes = draw(st.permutations(shapes))
    return shapes, batch, world, draw(st.booleans())


@settings(max_examples=30, deadline=None)
@given(
    bucket_layouts(), st.integers(0, 2**31), st.lists(st.integers(0, 60), min_size=1, max_size=5)
)
def test_bucketed_batch_is_a_pure_function_of_step_rank_and_world(layout, seed, steps):
    shapes, batch, world, drop_last = layout
    a = BucketedOrder(shapes, key=fr.key(seed), batch_size=batch, drop_last=drop_last)
    b = BucketedOrder(shapes, key=fr.key(seed), batch_size=batch, drop_last=drop_last)
    queries = [(s, r) for s in steps for r in range(world)]
    first = [a.indices(s, rank=r, world_size=world) for s, r in queries]
    again = [b.indices(s, rank=r, world_size=world) for s, r in reversed(queries)][::-1]
    assert first == again
    for s in steps:  # every rank of a step draws from one bucket: the batch stacks
        drawn = {shapes[i] for r in range(world) for i in a.indices(s, rank=r, world_size=world)}
        assert drawn == {a.buckets[a.bucket_of(s, world_size=world)]}


@settings(max_examples=30, deadline=None)
@given(bucket_layouts(), st.integers(0, 2**31), st.integers(0, 60))
def test_bucketed_world_size_w_reshards_to_one_rank_exactly(layout, seed, step):
    shapes, batch, world, drop_last = layout
    per_rank = BucketedOrder(shapes, key=fr.key(seed), batch_size=batch, drop_last=drop_last)
    one_rank = BucketedOrder(
        shapes, key=fr.key(seed), batch_size=batch * world, drop_last=drop_last
    )
    flat = [i for r in range(world) for i in per_rank.indices(step, rank=r, world_size=world)]
    assert flat == one_rank.indices(step)


@settings(max_examples=20, deadline=None)
@given(bucket_layouts(), st.integers(0, 2**31), st.integers(0, 2))
def test_a_bucketed_epoch_draws_each_item_at_most_once(layout, seed, epoch):
    shapes, batch, world, _ = layout
    order = BucketedOrder(shapes, key=fr.key(seed), batch_size=batch)
    spe = order.steps_per_epoch(world)
    seen = [
        i
        for s in range(epoch * spe, (epoch + 1) * spe)
        for r in range(world)
        for i in order.indices(s, rank=r, world_size=world)
    ]
    assert len(seen) == len(set(seen)) == spe * batch * world
    g = batch * world  # each bucket gives its whole global batches, the tails are dropped
    for b in range(len(order.buckets)):
        members = order.members(b)
        assert len(set(seen) & set(members)) == len(members) // g * g


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 30), st.integers(1, 3), st.integers(0, 2**31), st.booleans())
def test_one_shape_is_shuffled_source_order(num, batch, seed, drop_last):
    batch = min(batch, num)
    order = BucketedOrder([(4, 2)] * num, key=fr.key(seed), batch_size=batch, drop_last=drop_last)
    plain = ShuffledSource(
        list(range(num)), key=fr.key(seed), batch_size=batch, drop_last=drop_last
    )
    assert [order.indices(s) for s in range(12)] == [plain.indices(s) for s in range(12)]


def test_bucketed_order_refuses_a_global_batch_no_bucket_holds():
    order = BucketedOrder([(1,), (2,), (2,)], key=fr.key(0), batch_size=2)
    assert order.steps_per_epoch() == 1
    with pytest.raises(ValueError, match="no shape bucket holds a global batch of 4"):
        order.indices(0, rank=0, world_size=2)


# ------------------------------------------------------------------------ worker loader


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucketed")
    items = make_dataset(root, 24, num_shapes=2, shard_size=5)
    return root, items


def expected_batch(ds, order, step, rank=0, world=1):
    from torch.utils.data import default_collate

    return default_collate([ds[i] for i in order.indices(step, rank=rank, world_size=world)])


def test_worker_batches_are_the_orders_batches_in_any_start(bucketed):
    root, _ = bucketed
    ds = LatentDataset(root)
    order = BucketedOrder(ds.shapes, key=fr.key(3), batch_size=2)
    with WorkerSource(ds, order, num_workers=2, prefetch=2) as data:
        from_zero = [data.batch(s) for s in range(7)]
        assert data.restarts == 1  # consecutive steps: one DataLoader, prefetching
    with WorkerSource(ds, order, num_workers=2) as data:
        resumed = [data.batch(s) for s in range(4, 7)]  # "resumed at step 4"
    for s in range(7):
        assert_batches_equal(from_zero[s], expected_batch(ds, order, s))
    for s, batch in zip(range(4, 7), resumed):
        assert_batches_equal(batch, from_zero[s])


def test_worker_world_size_two_reshards_to_one_exactly(bucketed):
    root, _ = bucketed
    ds = LatentDataset(root)
    two = [latent_source(root, key=fr.key(5), batch_size=2, num_workers=1) for _ in range(2)]
    one = latent_source(root, key=fr.key(5), batch_size=4, num_workers=2)
    try:
        for s in range(4):
            parts = [two[r].batch(s, rank=r, world_size=2) for r in range(2)]
            whole = one.batch(s)
            for name in ("latents", "text", "index"):
                assert torch.equal(torch.cat([p[name] for p in parts]), whole[name])
            assert parts[0]["caption"] + parts[1]["caption"] == whole["caption"]
            assert len({tuple(x.shape) for x in whole["latents"]}) == 1
        assert len(ds) == 24
    finally:
        for src in (*two, one):
            src.close()


def test_a_non_consecutive_step_restarts_the_loader(bucketed):
    root, _ = bucketed
    with latent_source(root, key=fr.key(1), batch_size=2, num_workers=1) as data:
        ds, order = data.dataset, data.order
        for s in (0, 1, 5, 6, 2, 2):
            assert_batches_equal(data.batch(s), expected_batch(ds, order, s))
        assert data.restarts == 4  # at 0, 5, 2 and the repeated 2


def test_close_shuts_the_workers_down(bucketed):
    root, _ = bucketed
    before = {p.pid for p in multiprocessing.active_children()}
    data = latent_source(root, key=fr.key(1), batch_size=2, num_workers=2)
    data.batch(0)
    workers = {p.pid for p in multiprocessing.active_children()} - before
    assert len(workers) == 2
    data.close()
    assert not workers & {p.pid for p in multiprocessing.active_children()}
    data.batch(1)  # usable again: starts new workers
    data.close()


def test_a_damaged_shard_fails_the_step_that_reads_it_naming_rank_file_and_row(tmp_path, capsys):
    items = make_dataset(tmp_path, 16, shard_size=4)
    order = BucketedOrder(LatentDataset(tmp_path).shapes, key=fr.key(2), batch_size=2)
    bad_step = 3
    bad = order.indices(bad_step, rank=1, world_size=2)[1]
    path, row = _flip_row(tmp_path, bad, items)
    sources = [WorkerSource(LatentDataset(tmp_path), order, num_workers=1) for _ in range(2)]
    try:
        for s in range(bad_step):
            for r in range(2):
                sources[r].batch(s, rank=r, world_size=2)
        sources[0].batch(bad_step, rank=0, world_size=2)  # rank 0's items are whole
        with pytest.raises(ShardError) as raised:
            sources[1].batch(bad_step, rank=1, world_size=2)
    finally:
        for src in sources:
            src.close()
    message = str(raised.value)
    assert message.startswith(f"rank 1 of 2, step {bad_step} ")
    assert f"damaged shard '{path}', row {row} (item {bad})" in message
    assert "fvstep: data error: rank 1 of 2" in capsys.readouterr().err


class _Flaky:
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        if i == self.bad:
            raise KeyError(f"no item {i} here")
        return {"x": torch.tensor([i])}


def test_a_worker_exception_is_raised_in_the_main_process_with_its_traceback():
    order = ShuffledSource(list(range(8)), key=fr.key(0), batch_size=2)
    bad_step = next(s for s in range(4) if 5 in order.indices(s))
    with WorkerSource(_Flaky(5), order, num_workers=1) as data:
        for s in range(bad_step):
            data.batch(s)
        with pytest.raises(RuntimeError, match=rf"rank 0 of 1, step {bad_step} .*KeyError") as e:
            data.batch(bad_step)
    # Raised here, in the main process, with the worker's own traceback in the message.
    assert "no item 5 here" in str(e.value) and "in __getitem__" in str(e.value)


def test_missing_shard_after_start_is_named(tmp_path):
    make_dataset(tmp_path, 8, shard_size=4)
    with latent_source(tmp_path, key=fr.key(0), batch_size=4, num_workers=0) as data:
        (tmp_path / shard_name(1)).unlink()
        with pytest.raises(
            ShardError, match=rf"rank 0 of 1, step \d.*missing shard '{tmp_path / shard_name(1)}'"
        ):
            for s in range(2):
                data.batch(s)


# ----------------------------------------------------------------- through the executor


def _factory(root):
    def factory():
        net = nn.Linear(8, 1)
        with torch.no_grad():
            net.weight.copy_(torch.linspace(-1, 1, 8))
            net.bias.zero_()

        def loss(state, batch, key):
            x = batch["latents"].flatten(2).mean(-1)  # (B, 2)
            t = batch["text"].float().flatten(1)[:, :6]  # (B, 6)
            return state.module("net")(torch.cat([x, t], 1)).pow(2).mean()

        state = fs.TrainState.create(
            {"net": fs.Role(net, optimizer=fs.optim.adamw(lr=1e-2))}, key=fr.key(0)
        )
        data = latent_source(root, key=fr.key(7), batch_size=2, num_workers=1)
        return state, fs.compile(fs.update("net", loss)), data

    return factory


def test_resume_is_exact_over_the_worker_loader(bucketed, tmp_path):
    root, _ = bucketed
    assert_resume_exact(_factory(root), num_steps=6, interruptions=[2, 4], workdir=tmp_path)


# ----------------------------------------------------------------------------- benchmark


def test_loader_benchmark_reports_rows_for_each_worker_count(capsys, tmp_path):
    from benchmarks import data as bench

    rows = bench.run_benchmark(
        workers=[0], shape=(2, 1, 2, 2), text_shape=(3, 4), num_samples=4, steps=3, step_time_s=0.01
    )
    assert [(r["mode"], r["workers"]) for r in rows] == [("throughput", 0), ("wait", 0)]
    assert all(r["samples_per_s"] > 0 and 0 <= r["wait_fraction"] <= 1 for r in rows)
    assert rows[1]["step_s"] == 0.01
    args = ["--workers", "0", "--shape", "2", "--text-shape", "2", "--samples", "2", "--steps", "2"]
    assert bench.main([*args, "--json", str(tmp_path / "rows.json")]) == 0
    assert "samples/s" in capsys.readouterr().out and (tmp_path / "rows.json").exists()


def test_a_device_moves_every_tensor_of_the_batch(bucketed):
    root, _ = bucketed
    with latent_source(root, key=fr.key(1), batch_size=2, num_workers=0, device="meta") as data:
        batch = data.batch(0)
    assert {
        name: batch[name].device.type for name in ("latents", "text", "index")
    } == dict.fromkeys(("latents", "text", "index"), "meta")
    assert batch["caption"] == [f"clip {i}" for i in data.indices(0)]


# torch's SIGCHLD handler raises "worker is killed" from whatever Python code runs at that
# moment; when that is a gc callback (dynamo registers one), Python reports it as
# unraisable instead: the error this test asserts still reaches the caller.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_killed_worker_is_an_error_in_the_main_process(bucketed):
    import signal

    root, _ = bucketed
    before = {p.pid for p in multiprocessing.active_children()}
    data = latent_source(root, key=fr.key(1), batch_size=2, num_workers=1)
    try:
        data.batch(0)
        (worker,) = [p for p in multiprocessing.active_children() if p.pid not in before]
        # torch notices at once (SIGCHLD), or the next batch cannot be handed over.
        died = f"DataLoader worker \\(pid {worker.pid}\\) is killed"
        died += "|rank 0 of 1, step \\d+: the data loader failed"
        with pytest.raises(RuntimeError, match=died):
            os.kill(worker.pid, signal.SIGKILL)
            for s in range(1, 200):
                data.batch(s)
    finally:
        data.close()


@pytest.mark.skipif(
    not os.environ.get("FVSTEP_PYARROW_FLOOR"), reason="set by .ci/run's oldest-pyarrow pass"
)
def test_the_oldest_supported_pyarrow_is_the_one_tested():
    # .ci/run runs this file again with pyproject.toml's floor of pyarrow first on the
    # path: this checks that it was that pyarrow the other tests read with.
    import re
    from pathlib import Path

    import pyarrow

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"pyarrow>=(\d+)"', text)
    assert floor is not None
    assert pyarrow.__version__.split(".")[0] == floor.group(1), pyarrow.__version__


def test_tensor_bytes_are_read_from_an_arrow_buffer_without_its_buffer_protocol_quirks():
    # pyarrow < 26's Buffer refused torch.frombuffer ("could not retrieve buffer from
    # object"); the reader goes through a memoryview. Run under the oldest pyarrow by .ci/run.
    import pyarrow as pa

    from fvstep.executor.latents.dataset import _tensor

    data = torch.arange(6, dtype=torch.float32)
    buffer = pa.table({"x": [data.numpy().tobytes()]}).column("x")[0].as_buffer()
    out = _tensor(buffer, torch.float32, 6)
    assert torch.equal(out, data)
