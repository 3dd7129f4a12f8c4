"""Trackers: each one's output read back (JSONL, TensorBoard event files, W&B offline run
files), media included; metrics reach them in batches, never one host sync per step."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

import fvstep as fs
from fvstep.executor.media import Video, strip, write_gif, write_mp4, write_png_strip
from fvstep.executor.trackers import JsonlTracker, MetricsQueue, TensorBoardTracker, WandbTracker

imageio = pytest.importorskip("imageio.v3")


def video(num_frames: int = 5, height: int = 6, width: int = 8) -> Video:
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (num_frames, height, width, 3), generator=g, dtype=torch.uint8)
    return Video(frames, fps=8, caption="a cat")


def tiny_run():
    torch.manual_seed(0)
    state = fs.TrainState.create(
        {"net": fs.Role(torch.nn.Linear(4, 4), optimizer=fs.optim.adamw(lr=1e-2))},
        key=fs.random.key(0),
    )

    def loss(state, batch, key):
        return ((state.module("net")(batch["x"]) - batch["y"]) ** 2).mean()

    def data(step):
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(2, 4, generator=g), "y": torch.randn(2, 4, generator=g)}

    return state, fs.compile(fs.update("net", loss)), data


# --- the queue ----------------------------------------------------------------------------


def test_metrics_queue_keeps_order_reads_scalars_and_nulls_nonfinite_values():
    q = MetricsQueue()
    q.put(0, {"a": torch.tensor(0.5), "b": 2, "v": torch.ones(3), "s": "text", "n": math.nan})
    q.put(1, {"a": torch.tensor([float("inf")]), "flag": True})
    assert len(q) == 2
    assert q.flush() == [(0, {"a": 0.5, "b": 2, "n": None}), (1, {"a": None, "flag": True})]
    assert q.flush() == []
    counter = torch.zeros(())
    q.put(0, {"count": counter})
    counter += 1  # a metric updated in place after the step: the queue kept step 0's value
    assert q.flush() == [(0, {"count": 0.0})]


def test_run_hands_metrics_over_in_batches_not_every_step(tmp_path):
    events = []

    class Recorder:
        def start(self, step):
            events.append(("start", step))

        def log(self, metrics, step):
            events.append(("log", step))

        def log_media(self, media, step):
            events.append(("media", step))

        def close(self):
            events.append(("close",))

    state, step, data = tiny_run()
    fs.run(
        step,
        state,
        data,
        num_steps=6,
        trackers=[Recorder()],
        log_every=4,
        progress=False,
        on_metrics=lambda s, m: events.append(("step", s)),
    )
    assert events == [
        ("start", 0),
        *[("step", s) for s in range(4)],
        *[("log", s) for s in range(4)],
        *[("step", s) for s in range(4, 6)],
        *[("log", s) for s in range(4, 6)],
        ("close",),
    ]
    state, step, data = tiny_run()
    with pytest.raises(ValueError, match="log_every"):
        fs.run(step, state, data, num_steps=1, log_every=0)


# --- JSONL ----------------------------------------------------------------------------------


def test_jsonl_tracker_writes_strict_lines_and_media_and_drops_recomputed_steps(tmp_path):
    t = JsonlTracker(tmp_path / "m.jsonl", gif=True)
    t.start(0)
    for s in range(4):
        t.log({"loss": s / 2, "bad": None}, s)
    t.log({}, 4)  # nothing: no line
    t.log_media({"val/sample_0": video()}, 2)
    t.close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    assert json.loads(lines[1]) == {"step": 1, "loss": 0.5, "bad": None}
    folder = tmp_path / "media" / "step_000000002"
    assert sorted(p.name for p in folder.iterdir()) == [
        "val_sample_0.gif",
        "val_sample_0.mp4",
        "val_sample_0.png",
    ]
    mp4 = imageio.imread(folder / "val_sample_0.mp4", plugin="pyav")
    assert mp4.shape == (5, 6, 8, 3)
    assert imageio.imread(folder / "val_sample_0.png").shape == (6, 5 * 8, 3)
    gif = imageio.imread(folder / "val_sample_0.gif", index=None)
    assert gif.shape[:3] == (5, 6, 8)

    resumed = JsonlTracker(tmp_path / "m.jsonl")
    resumed.start(2)
    resumed.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "m.jsonl").read_text().splitlines()] == [
        0,
        1,
    ]
    assert not folder.exists()


def test_a_strip_picks_evenly_spaced_frames_and_a_video_refuses_wrong_frames():
    v = video(num_frames=3, height=5, width=7)  # odd sizes are padded for H.264
    assert strip(v, max_frames=2).shape == (5, 14, 3)
    with pytest.raises(TypeError, match="uint8"):
        Video(torch.zeros(2, 4, 4, 3), fps=8)
    with pytest.raises(ValueError, match="F, H, W, 3"):
        Video(torch.zeros(2, 4, 4, dtype=torch.uint8), fps=8)


def test_media_png_strip_is_the_frames_side_by_side(tmp_path):
    v = video()
    png = imageio.imread(write_png_strip(v, tmp_path / "s.png", max_frames=5))
    assert torch.equal(torch.from_numpy(png), torch.cat(list(v.frames), dim=1))
    mp4 = imageio.imread(write_mp4(video(height=5, width=7), tmp_path / "odd.mp4"), plugin="pyav")
    assert mp4.shape == (5, 6, 8, 3)
    assert write_gif(v, tmp_path / "g.gif").stat().st_size > 0


# --- TensorBoard -----------------------------------------------------------------------------


def event_accumulator(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_tracker_event_files_read_back_with_media(tmp_path):
    pytest.importorskip("tensorboard")
    t = TensorBoardTracker(tmp_path / "tb")
    t.start(0)
    for s in range(3):
        t.log({"loss": 1.0 + s, "nan": None}, s)
    t.log_media({"val/sample_0": video()}, 2)
    t.close()
    acc = event_accumulator(tmp_path / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert "nan" not in acc.Tags()["scalars"]
    (image,) = acc.Images("val/sample_0")
    assert (image.step, image.width, image.height) == (2, 5 * 8, 6)


def test_run_with_tensorboard_purges_recomputed_steps_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    ckpt = fs.Checkpoints(tmp_path / "ckpt", every=2)
    state, step, data = tiny_run()
    fs.run(
        step,
        state,
        data,
        num_steps=3,
        checkpoints=ckpt,
        progress=False,
        trackers=[TensorBoardTracker(tmp_path / "tb")],
    )
    state, step, data = tiny_run()
    # resumes from step 3 (the final save): nothing purged, steps 3..4 appended
    fs.run(
        step,
        state,
        data,
        num_steps=5,
        checkpoints=ckpt,
        progress=False,
        trackers=[TensorBoardTracker(tmp_path / "tb")],
    )
    steps = [e.step for e in event_accumulator(tmp_path / "tb").Scalars("net/loss")]
    assert steps == [0, 1, 2, 3, 4]


def test_run_without_trackers_writes_only_the_jsonl_and_tensorboard_only_when_asked(tmp_path):
    pytest.importorskip("tensorboard")
    state, step, data = tiny_run()
    fs.run(step, state, data, num_steps=2, metrics_path=tmp_path / "m.jsonl", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]  # no hidden default
    state, step, data = tiny_run()
    board = tmp_path / "n" / "tensorboard"
    fs.run(
        step,
        state,
        data,
        num_steps=2,
        metrics_path=tmp_path / "n" / "m.jsonl",
        progress=False,
        trackers=[TensorBoardTracker(board)],
    )
    assert [e.step for e in event_accumulator(board).Scalars("net/loss")] == [0, 1]


# --- Weights & Biases (offline) -----------------------------------------------------------------


def wandb_records(run_file: Path):
    """The records of a W&B run file (a LevelDB-style log of protobuf ``Record``s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    block, pos, pending = 32768, 7, b""  # 7 bytes of header: ":W&B" + version
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last piece
            record = pb.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record
        elif kind in (2, 3):  # first, middle
            pending = chunk if kind == 2 else pending + chunk


def wandb_history(directory: Path) -> tuple[list[dict], Path]:
    (run_dir,) = (directory / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    history = []
    for r in wandb_records(run_file):
        if r.WhichOneof("record_type") == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            )
    return history, run_dir


def test_wandb_offline_run_files_read_back_with_media(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = WandbTracker(project="fvstep-test", dir=tmp_path)
    t.start(0)
    t.log({"loss": 0.5, "nan": None}, 0)
    t.log({"loss": 0.25}, 1)
    t.log_media({"val/sample_0": video()}, 1)
    t.close()
    wandb.teardown()  # waits for W&B's service process to write everything out
    history, run_dir = wandb_history(tmp_path)
    assert [(h["_step"], h.get("loss")) for h in history] == [(0, 0.5), (1, 0.25)]
    assert "nan" not in history[0]
    assert history[1]["val/sample_0/_type"] == "video-file"
    assert history[1]["val/sample_0/caption"] == "a cat"
    mp4 = run_dir / "files" / history[1]["val/sample_0/path"]
    assert imageio.imread(mp4, plugin="pyav").shape == (5, 6, 8, 3)
