"""Streaming self-forcing (fvstep.methods.streaming): a stream that spans steps keeps all
of its state in TrainState.extra, so a resume mid-stream is bitwise the uninterrupted run
(1 process and 2 gloo ranks, K = 2, an odd step); the same method with the stream on a
Python attribute is caught by ``fvstep verify-resume``; per-rank streams refuse another
world size; the step equals a hand-written imperative loop, in one process and on 2 FSDP2
gloo ranks."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import pytest
import torch

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.checkpoint import CheckpointError
from fvstep.core import tree
from fvstep.core.random import fold_in, fold_in_name, split
from fvstep.core.state import is_consumed
from fvstep.methods.causal_rollout import exit_steps, regenerate, rollout
from fvstep.methods.causal_wan import make_causal
from fvstep.methods.models import synthetic_batch, tiny_wan
from fvstep.methods.self_forcing import critic_loss_on, dmd_loss_on
from fvstep.methods.streaming import StreamState, init_stream, streaming
from fvstep.testing import assert_resume_exact
from tests.refusals import assert_refused_before_any_change

STEPS = (1.0, 0.5)
OPTIONS = {
    "steps_per_stream": 4,
    "window_frames": 1,
    "sink_frames": 1,
    "denoising_steps": STEPS,
    "guidance_scale": 1.5,
}


class StreamData:
    """Per-rank batches of one latent frame: a pure function of (step, rank)."""

    def batch(self, step: int, *, rank: int = 0, world_size: int = 1) -> dict:
        return synthetic_batch(
            fold_in(fold_in(fs.random.key(7), step), rank), batch_size=2, frames=1
        )


def _modules(sharded: bool) -> dict[str, torch.nn.Module]:
    modules = {
        "student": make_causal(tiny_wan(seed=0), chunk_frames=1),
        "teacher": tiny_wan(seed=0),
        "critic": tiny_wan(seed=1),
    }
    if sharded:
        mesh = fsp.make_mesh(device_type="cpu")
        modules = {r: fsp.shard_module(m, mesh=mesh) for r, m in modules.items()}
    return modules


def _adamw() -> fs.optim.Optimizer:
    return fs.optim.adamw(lr=1e-3, weight_decay=0.01)


def _state(modules: dict[str, torch.nn.Module]) -> fs.TrainState:
    stream = init_stream(modules["student"], StreamData().batch(0), window_frames=1, sink_frames=1)
    return fs.TrainState.create(
        {
            "student": fs.Role(modules["student"], optimizer=_adamw()),
            "teacher": fs.Role(modules["teacher"]),
            "critic": fs.Role(modules["critic"], optimizer=_adamw()),
        },
        key=fs.random.key(3),
        extra={"stream": stream},
    )


def _compiled(method: fs.Step) -> fs.Step:
    return fs.compile(method, accumulation=fs.Accumulation(2))


def factory(sharded: bool = False):
    """``(state, step_fn, data)`` of the real streaming method."""
    return _state(_modules(sharded)), _compiled(streaming(**OPTIONS)), StreamData()


class AttributeStream:
    """The same method, written the way the reference trainer's was: the stream lives on a
    Python attribute between steps (``extra`` only ever sees the initial stream)."""

    def __init__(self, initial: StreamState) -> None:
        self.pure = streaming(**OPTIONS).fn
        self.stream = initial

    def __call__(self, state, batch, key, ctx):
        initial = state.extra["stream"]
        state, metrics = self.pure(state.replace(extra={"stream": self.stream}), batch, key, ctx)
        self.stream = state.extra["stream"]
        return state.replace(extra={"stream": initial}), metrics


def impure_factory():
    state = _state(_modules(sharded=False))
    method = fs.managed(
        AttributeStream(state.extra["stream"]), trains=("student", "critic"), name="stream"
    )
    return state, _compiled(method), StreamData()


def test_a_resume_mid_stream_is_bitwise_the_uninterrupted_run(tmp_path):
    """K = 2, a crash before step 1 of a 4-step stream (an odd step, mid-stream); after
    the resume the cache (sink 1 + window 1) fills and rolls: the resumed run continues
    the stream exactly."""
    final = assert_resume_exact(
        factory, num_steps=3, interruptions=[1], workdir=tmp_path, checkpoint_every=1
    )
    stream = final.extra["stream"]
    assert int(stream.num_frames) == 3 and int(stream.cache.num_frames) == 2
    assert stream.frames.abs().sum() > 0


def test_verify_resume_catches_the_stream_on_a_python_attribute_and_passes_the_real_one(
    tmp_path, monkeypatch
):
    from fvstep.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])

    def verify(name: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(
                ["verify-resume", f"tests.test_streaming:{name}", "--steps", "2",
                 "--interrupt", "1", "--every", "1", "--workdir", str(tmp_path / name)]
            )  # fmt: skip
        return code, out.getvalue()

    code, text = verify("impure_factory")
    assert code != 0 and "resume is NOT exact" in text, text
    code, text = verify("factory")
    assert code == 0, text


def _hand_written_loop(modules, *, num_steps: int, rank: int):
    """Streaming by hand on rank ``rank``: the stream in a local variable, torch.optim.AdamW,
    the micro-batches split by hand (FSDP2's default flags: ``sync="every"``), the engine's
    keys (managed step ``stream``; exit steps from the shared key, every other draw from
    the rank's key, the rank's batch). Returns the optimizers and the final stream."""
    modules["teacher"].requires_grad_(False)
    optimizers = {
        r: torch.optim.AdamW(modules[r].parameters(), lr=1e-3, weight_decay=0.01)
        for r in ("student", "critic")
    }
    view = _View(modules)
    stream = init_stream(modules["student"], StreamData().batch(0), window_frames=1, sink_frames=1)
    for i in range(num_steps):
        batch = StreamData().batch(i, rank=rank)
        view.step = i
        if i % 4 == 0:
            stream = init_stream(modules["student"], batch, window_frames=1, sink_frames=1)
            stream = StreamState(
                stream.cache, stream.frames, batch["text"].clone(), stream.num_frames
            )
        key = fold_in_name(fold_in(fold_in(fs.random.key(3), i), rank), "stream")
        k_rollout, k_generator, k_critic = split(key, 3)
        exits = exit_steps(fs.random.key(3), i, 1, len(STEPS))
        with torch.no_grad():
            ro = rollout(modules["student"], batch["latents"], stream.text, k_rollout, exits=exits,
                         denoising_steps=STEPS, cache=stream.cache)  # fmt: skip
        for role, key_u in (("student", k_generator), ("critic", k_critic)):
            for m in range(2):
                rows = slice(m, m + 1)
                text = stream.text[rows]
                if role == "student":
                    contexts = [_rows(c, rows) for c in ro.contexts]
                    video = regenerate(modules["student"], [x[rows] for x in ro.exit_inputs],
                                       ro.exit_times, contexts, text)  # fmt: skip
                    loss, _ = dmd_loss_on(view, video, text, fold_in(key_u, m), guidance_scale=1.5)
                else:
                    loss, _ = critic_loss_on(view, ro.video[rows], text, fold_in(key_u, m))
                (loss / 2).backward()
            optimizers[role].step()
            optimizers[role].zero_grad(set_to_none=True)
        frames = torch.cat([stream.frames, ro.video], 2)[:, :, -1:]
        stream = StreamState(ro.cache, frames, stream.text, stream.num_frames + 1)
    return optimizers, stream


def _assert_equal_to_loop(state, modules, optimizers, stream) -> int:
    """Every parameter and both AdamW moments of student and critic, and the stream;
    returns the number of parameters compared."""
    compared = 0
    for role in ("student", "critic"):
        params = dict(modules[role].named_parameters())
        tree.assert_trees_equal(state.roles[role].params, params)
        moments = {n: optimizers[role].state[p] for n, p in params.items()}
        for moment in ("exp_avg", "exp_avg_sq"):
            tree.assert_trees_equal(
                getattr(state.roles[role].opt_state, moment),
                {n: s[moment] for n, s in moments.items()},
            )
        compared += len(params)
    tree.assert_trees_equal(state.extra["stream"], stream)
    return compared


def test_the_step_is_bitwise_a_hand_written_streaming_loop():
    """Three steps in one process, K = 2: parameters, AdamW moments and the stream."""
    modules = _modules(sharded=False)
    state = _state({r: _copy(m) for r, m in modules.items()})
    step = _compiled(streaming(**OPTIONS))
    for i in range(3):
        state, _ = step(state, StreamData().batch(i))
    _assert_equal_to_loop(state, modules, *_hand_written_loop(modules, num_steps=3, rank=0))


def test_a_new_stream_holds_no_cache_memory_so_a_run_holds_one_cache():
    """The state given to the first step stays alive for a whole run (its caller holds it):
    a new stream's cache is one expanded zero, never read (the first step restarts it), so
    the run holds one cache; steps stay functional: they never write into their input."""
    state, step, data = factory()
    first = state.extra["stream"].cache
    assert first.keys.untyped_storage().nbytes() == first.keys.element_size()
    for i in range(3):
        state, _ = step(state, data.batch(i))
        cache = state.extra["stream"].cache
        assert (
            cache.keys.untyped_storage().nbytes() == cache.keys.numel() * cache.keys.element_size()
        )
        assert cache.keys.shape == first.keys.shape and int(cache.num_frames) == min(i + 1, 2)
    assert not first.keys.any() and not first.values.any()


def test_two_runs_from_one_stream_object_are_each_the_run_from_its_own():
    """Sharing one ``init_stream`` result between states (an A/B run) changes nothing."""
    stream = _state(_modules(sharded=False)).extra["stream"]
    shared = [_state(_modules(sharded=False)).replace(extra={"stream": stream}) for _ in range(2)]
    alone, step, data = factory()
    for i in range(3):
        shared = [step(s, data.batch(i))[0] for s in shared]
        alone, _ = step(alone, data.batch(i))
    for s in shared:
        tree.assert_trees_equal(s.extra["stream"], alone.extra["stream"])
        tree.assert_trees_equal(s.roles["critic"].params, alone.roles["critic"].params)


def test_the_step_function_alone_refuses_a_batch_whose_text_does_not_match_its_latents():
    """``streaming(...).fn`` re-wrapped without the method's input check (as
    ``AttributeStream`` does) still refuses a bad batch rather than broadcasting its text.
    Found by review of issue 36: the step's body had come to rely on ``check_input``."""
    good = StreamData().batch(0)
    bad = {**good, "text": good["text"][:1]}  # one prompt for two videos
    fn = streaming(**OPTIONS).fn
    step = fs.compile(fs.managed(fn, trains=("student", "critic"), name="stream"))
    with pytest.raises(fs.StepFailedError) as raised:
        step(_state(_modules(sharded=False)), bad)
    assert "must agree" in str(raised.value.__cause__)


def check_two_fsdp2_ranks_against_the_loop(rank: int, world_size: int) -> tuple[int, list]:
    from benchmarks.reference import reshard_all

    state, step, data = factory(sharded=True)
    for i in range(2):
        state, _ = step(state, data.batch(i, rank=rank), parallelism=fsp.Layout())
        assert fsp.unrested_modules(state) == [], fsp.unrested_modules(state)[:3]
    ref = _modules(sharded=True)
    optimizers, stream = _hand_written_loop(ref, num_steps=2, rank=rank)
    reshard_all(ref)
    compared = _assert_equal_to_loop(state, ref, optimizers, stream)
    return compared, stream.frames.flatten()[:4].tolist()


@pytest.mark.multirank
def test_the_step_on_two_fsdp2_ranks_is_bitwise_the_hand_written_loop(ranks):
    """Two steps on 2 FSDP2 gloo ranks (sharded with ``shard_module``), K = 2: every
    parameter and AdamW moment of student and critic, sharded, and each rank's own stream
    in ``state.extra`` equal the hand-written loop's bitwise; the two streams differ."""
    (compared, first), (again, second) = ranks.run(check_two_fsdp2_ranks_against_the_loop)
    assert compared == again > 2 * 10  # every parameter of student and critic
    assert first != second


class _View:
    def __init__(self, modules):
        self.modules = modules
        self.key = fs.random.key(3)
        self.step = 0

    def module(self, name):
        return self.modules[name]


def _copy(module):
    import copy

    return copy.deepcopy(module)


def _rows(cache, rows):
    return type(cache)(
        keys=cache.keys[rows],
        values=cache.values[rows],
        num_frames=cache.num_frames,
        frame_tokens=cache.frame_tokens,
        sink_frames=cache.sink_frames,
        slots=cache.slots,
    )


def check_resume_on_two_ranks(rank: int, world_size: int, workdir: str) -> list[float]:
    final = assert_resume_exact(
        lambda: factory(sharded=True), num_steps=2, interruptions=[1], workdir=workdir,
        checkpoint_every=1,
    )  # fmt: skip
    return final.extra["stream"].frames.flatten()[:4].tolist()


@pytest.mark.multirank
def test_a_resume_mid_stream_is_bitwise_on_two_ranks_and_refused_on_one(ranks, tmp_path):
    """Each rank runs its own stream (different frames); the checkpoint holds them per
    rank, so it resumes on 2 ranks exactly and is refused on 1 with a clear error; loaded
    on 1 with the stream reset (at step 2, mid-stream), it starts a new stream exactly."""
    first, second = ranks.run(check_resume_on_two_ranks, str(tmp_path))
    assert first != second
    latest = fs.checkpoint.latest(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match="per-rank values"):
        fs.checkpoint.load(latest, like=_state(_modules(sharded=False)))
    # the way the error names: new streams, which start as new streams do
    _assert_a_reset_stream_starts_as_a_new_one(latest, at_step=2)


def test_a_state_without_its_stream_and_bad_settings_are_refused():
    state = _state(_modules(sharded=False))
    state = state.replace(extra={})
    with pytest.raises(ValueError, match=r"streaming needs state.extra\['stream'\].*no stream"):
        _compiled(streaming(**OPTIONS))(state, StreamData().batch(0))
    assert not is_consumed(state)
    with pytest.raises(ValueError, match="steps_per_stream"):
        streaming(steps_per_stream=0, window_frames=2)
    with pytest.raises(ValueError, match="window_frames"):
        init_stream(make_causal(tiny_wan()), synthetic_batch(fs.random.key(0), frames=3),
                    window_frames=2)  # fmt: skip


def _other_stream(**init) -> StreamState:
    return init_stream(make_causal(tiny_wan(seed=0), chunk_frames=1), StreamData().batch(0), **init)


@pytest.mark.parametrize(
    ("edit", "batch", "match"),
    [
        # the window and sink of the method, not init_stream's (same capacity: 2 frames)
        ({"stream": _other_stream(window_frames=2)}, {}, "window_frames=1, sink_frames=1"),
        ({"stream": _other_stream(window_frames=2, sink_frames=0)}, {}, "got a stream of"),
        (
            {
                "stream": init_stream(
                    make_causal(tiny_wan(seed=0, num_layers=1), chunk_frames=1),
                    StreamData().batch(0),
                    window_frames=1,
                    sink_frames=1,
                )
            },
            {},
            "1 layers and the student 2",
        ),
        ({}, {"frames": 2}, "at most window_frames=1"),
        ({}, {"batch_size": 1}, r"\(batch, channels, height, width\) = \(1, 4, 4, 4\)"),
        ({}, {"text_len": 5}, "a new stream takes it as its prompt"),
    ],
    ids=["window", "sink", "layers", "frames", "batch-size", "text"],
)
def test_a_stream_or_batch_that_does_not_fit_is_refused_before_the_step_changes_anything(
    edit, batch, match
):
    state = _state(_modules(sharded=False))
    state = state.replace(extra={**state.extra, **edit})
    data = synthetic_batch(fs.random.key(2), **{"batch_size": 2, "frames": 1, **batch})
    assert_refused_before_any_change(state, _compiled(streaming(**OPTIONS)), data, match)


@pytest.mark.parametrize("role", ["teacher", "critic"])
def test_a_causal_teacher_or_critic_is_refused_naming_the_role(role):
    modules = _modules(sharded=False)
    modules[role] = copy.deepcopy(modules["student"])  # a copy of the causal student
    step = fs.compile(streaming(**OPTIONS))
    assert_refused_before_any_change(
        _state(modules), step, StreamData().batch(0), f"needs a bidirectional '{role}'"
    )


def test_bf16_latents_on_an_fp32_student_train_as_their_fp32_upcast_bitwise():
    data = StreamData().batch(0)
    low = {k: v.bfloat16() for k, v in data.items()}
    high = {k: v.float() for k, v in low.items()}
    step = fs.compile(streaming(**OPTIONS))
    results = []
    for batch in (low, high):
        modules = _modules(sharded=False)
        state = _state(modules).replace(extra={"stream": init_stream(
            modules["student"], batch, window_frames=1, sink_frames=1)})  # fmt: skip
        assert state.extra["stream"].text.dtype == torch.float32
        results.append(step(state, batch)[0])
    tree.assert_trees_equal(results[0], results[1], check_static=False)


def test_init_stream_and_streaming_refuse_what_the_stream_cannot_move_by():
    student = make_causal(tiny_wan(seed=0), chunk_frames=2)
    batch = synthetic_batch(fs.random.key(0), frames=2)
    with pytest.raises(ValueError, match=r"window_frames \(3\) must be a multiple"):
        init_stream(student, batch, window_frames=3)
    with pytest.raises(ValueError, match=r"a step's frames \(3\) must be a multiple"):
        init_stream(student, synthetic_batch(fs.random.key(0), frames=3), window_frames=4)
    for options, match in [
        ({"guidance_scale": -1.0}, "guidance_scale"),
        ({"shift": 0.0}, "shift"),
        ({"min_ratio": 0.9, "max_ratio": 0.1}, "min_ratio"),
        ({"denoising_steps": (0.5, 1.0)}, "strictly decreasing"),
        ({"context_time": 1.0}, "context_time"),
    ]:
        with pytest.raises(ValueError, match=match):
            streaming(steps_per_stream=2, window_frames=2, **options)


def test_an_accumulation_that_does_not_divide_the_batch_isassert_refused_before_any_change():
    """The input check is given the compiled step's accumulation: K = 2 on 3 samples."""
    modules = _modules(sharded=False)
    batch = synthetic_batch(fs.random.key(0), batch_size=3, frames=1)
    state = _state(modules).replace(
        extra={"stream": init_stream(modules["student"], batch, window_frames=1, sink_frames=1)}
    )
    step = _compiled(streaming(**OPTIONS))
    assert_refused_before_any_change(state, step, batch, "accumulation of 2 micro-batches does not")


def _assert_a_reset_stream_starts_as_a_new_one(path: Path, at_step: int) -> None:
    """Load ``path`` into a fresh state with the stream reset (``init_stream``'s: no
    frame, a zero prompt) at ``at_step``, not a stream boundary; step it. The state (roles,
    AdamW moments, and the stream's frames, prompt, cache and counter: all the next step
    reads) is bitwise that of the same step started as a new stream by the method itself
    (``steps_per_stream=1``: every step starts one, with the same keys and exit steps), and
    the prompt is the batch's."""
    assert at_step % OPTIONS["steps_per_stream"] != 0
    batch = StreamData().batch(at_step)
    results = []
    for every in (OPTIONS["steps_per_stream"], 1):
        like = _state(_modules(sharded=False))
        state = fs.checkpoint.load(path, like=like, reset=("extra.stream",))
        assert int(state.step) == at_step and int(state.extra["stream"].num_frames) == 0
        step = _compiled(streaming(**{**OPTIONS, "steps_per_stream": every}))
        results.append(step(state, batch)[0])
    reset, started = results
    tree.assert_trees_equal(reset, started, check_static=False)
    stream = reset.extra["stream"]
    assert stream.text.abs().max() > 0, "the reset stream trained on init_stream's zero prompt"
    tree.assert_trees_equal(stream.text, batch["text"])
    assert int(stream.num_frames) == 1


def test_a_stream_reset_off_a_boundary_starts_bitwise_as_a_new_stream_from_the_batch(tmp_path):
    """``load(reset=("extra.stream",))`` at step 1 of a 4-step stream (a checkpoint of
    step 0's state), then a step: exactly a new stream's first step."""
    state, _ = _compiled(streaming(**OPTIONS))(
        _state(_modules(sharded=False)), StreamData().batch(0)
    )
    fs.checkpoint.save(state, tmp_path / "ckpt")
    _assert_a_reset_stream_starts_as_a_new_one(tmp_path / "ckpt", at_step=1)
