"""``fvstep.recipes.planning``: the plan's bytes against a built state, measured activations and
KV caches, its predictions against the measured H200 rows, its suggestions, and the Wan
shape it counts from a config against the module diffusers builds."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fvstep import parallel as fsp
from fvstep.methods.models import tiny_wan
from fvstep.recipes import get_recipe, planning
from fvstep.recipes.config import parse_options

GIB = 2**30
CPU = ["--run.device", "cpu", "--run.progress", "false"]


def _options(recipe: str, *args: str) -> Any:
    return parse_options(get_recipe(recipe), [*CPU, *args])


def _tensor_bytes(x: Any) -> int:
    """Bytes of every tensor in ``x`` (dicts, sequences, attrs classes, None)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(v) for v in x)
    if attrs.has(type(x)):
        return sum(_tensor_bytes(getattr(x, f.name)) for f in attrs.fields(type(x)))
    return 0


@pytest.mark.parametrize(
    ("recipe", "argv"),
    [
        ("finetune", ()),
        ("finetune", ("--lora.rank", "4")),
        ("dmd2", ()),
        ("dmd2", ("--prepare.precision", "bf16")),
        ("lora_dmd2", ()),
        ("self_forcing", ()),
        ("streaming", ()),
        ("diffusion_nft", ()),
        ("diffusion_nft", ("--kl_weight", "0.1", "--prepare.precision", "bf16")),
    ],
    ids=[
        "finetune", "finetune-lora", "dmd2", "dmd2-bf16", "lora_dmd2", "self_forcing", "streaming",
        "diffusion_nft", "diffusion_nft-reference-bf16",
    ],
)  # fmt: skip
def test_the_plans_bytes_per_role_equal_the_built_states_after_a_step(
    recipe: str, argv: tuple[str, ...]
) -> None:
    options = _options(recipe, *argv)
    spec = get_recipe(recipe).build(options, fresh=True)
    state, _ = spec.step(spec.state, spec.data.batch(0))
    plan = planning.plan_run(recipe, options)
    assert sorted(r.name for r in plan.roles) == sorted(state.roles)
    for role in plan.roles:
        built = state.roles[role.name]
        params = {
            n: p for n, p in built.params.items() if not role.trained or n in built.trainable_names
        }
        assert role.weights == _tensor_bytes(params), role.name
        assert role.optimizer == _tensor_bytes(built.opt_state), role.name  # moments, steps
        assert role.ema == _tensor_bytes(built.ema), role.name
        grads = role.numel * 4 if role.trained else 0  # fp32, one per trained parameter
        assert role.gradients == grads


def test_fsdp2_divides_the_weights_moments_ema_and_gradients_by_the_world_size() -> None:
    options = _options("dmd2")
    one, eight = planning.plan_run("dmd2", options), planning.plan_run("dmd2", options, nproc=8)
    for a, b in zip(one.roles, eight.roles):
        assert (b.weights, b.gradients) == (a.weights / 8, a.gradients / 8)
        # AdamW's step counters and the EMA's flag are per rank, not sharded
        assert (b.optimizer, b.ema) == pytest.approx((a.optimizer / 8, a.ema / 8), rel=0.03)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages made inside it that are still alive (what a forward keeps)."""

    def __init__(self, existing: Any) -> None:
        super().__init__()
        self.made: list[tuple[Any, int]] = []
        self.existing = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made.append((StorageWeakRef(s), s.nbytes()))
        return out

    def alive(self, larger_than: int = 0) -> int:
        alive = {  # one a storage; a view of a weight is not made here
            ref.cdata: n
            for ref, n in self.made
            if not ref.expired() and ref.cdata not in self.existing and n > larger_than
        }
        return sum(alive.values())


def _kept_by_forward(mode: str, layers: int, side: int, bf16: bool) -> int:
    model = tiny_wan(
        num_layers=layers, dim_per_head=32, num_heads=4, ffn_dim=400, rope_max_seq_len=64
    )
    model = fsp.prepare(model, checkpointing=mode)
    x = torch.randn(1, 4, 2, side, side)
    scope = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    live = _LiveBytes(model.parameters())
    with scope, live:
        out = model(x, torch.tensor([500.0]), torch.randn(1, 8, 16), return_dict=False)[0]
        loss = out.float().square().mean()
    kept = live.alive()
    del loss
    return kept


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "full", "selective", "attention", "narrow"])
def test_saved_activations_per_block_are_the_model_within_10_percent(mode: str, bf16: bool) -> None:
    side = 16  # 2 x 8 x 8 = 128 video tokens
    measured = _kept_by_forward(mode, 2, side, bf16) - _kept_by_forward(mode, 1, side, bf16)
    shape = planning.ModelShape.of(
        tiny_wan(num_layers=1, dim_per_head=32, num_heads=4, ffn_dim=400, rope_max_seq_len=64)
    )
    predicted = planning.block_saved_bytes(
        shape, 128, checkpointing=mode, compute="bf16" if bf16 else "fp32"
    )
    assert predicted == pytest.approx(measured, rel=0.10)


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x`` (dicts, sequences, attrs classes), as :func:`_tensor_bytes` walks."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if attrs.has(type(x)):
        return [t for f in attrs.fields(type(x)) for t in _tensors(getattr(x, f.name))]
    return []


def _state_tensors(state: Any, batch: Any) -> list[torch.Tensor]:
    """Every tensor a state and a batch hold (what a measured call did not make): the
    roles' parameters, buffers (the rotary tables), optimizer state and EMA, the extras."""
    leaves = [*_tensors(batch), *_tensors(dict(state.extra))]
    for name, role in state.roles.items():
        leaves += [*role.params.values(), *_tensors(role.opt_state), *_tensors(role.ema)]
        leaves += list(state.module(name).buffers())
    return leaves


@pytest.mark.parametrize("benchmark", [False, True], ids=["recipe", "under-autocast"])
def test_the_kv_cache_is_what_the_self_forcing_rollout_allocates(benchmark: bool) -> None:
    from fvstep.methods.causal_rollout import rollout

    options = _options("self_forcing", "--prepare.precision", "bf16")
    spec = get_recipe("self_forcing").build(options, fresh=True)
    batch = spec.data.batch(0)
    student = spec.state.module("student")
    like = batch["latents"].float()  # the method's batch, cast to the student's dtype
    # the recipe's rollout makes its cache in the student's compute dtype (bf16);
    # benchmarks.realshape wraps the whole step in autocast (init_cache's default: bf16)
    scope = torch.autocast("cpu", dtype=torch.bfloat16) if benchmark else contextlib.nullcontext()
    live = _LiveBytes(_state_tensors(spec.state, batch))
    with scope, torch.no_grad(), live:  # the method rolls out without grad
        ro = rollout(
            student, like, batch["text"], torch.tensor([0, 1]), exits=(1, 0),
            denoising_steps=(1.0, 0.5),
            cache_dtype=None if benchmark else fsp.preparation(student).param_dtype,
        )  # fmt: skip
    measured = live.alive(larger_than=8) - _tensor_bytes((ro.video, ro.exit_inputs))
    plan = planning.plan_run("self_forcing", options, _benchmark=benchmark)
    assert plan.cache is not None
    assert ro.cache.keys.element_size() == plan.cache[2] == 2
    assert measured == plan.cache[0]
    assert {s.held for s in plan.steps} == {plan.cache[0]}  # one cache alive in each step


def test_the_self_forcing_recipes_rollout_keeps_its_cache_in_the_compute_dtype(
    monkeypatch: Any,
) -> None:
    import fvstep.methods.causal_rollout as rollouts

    made: list[torch.dtype] = []
    real = rollouts.init_cache

    def recorded(*args: Any, **kwargs: Any) -> Any:
        cache = real(*args, **kwargs)
        made.append(cache.keys.dtype)
        return cache

    monkeypatch.setattr(rollouts, "init_cache", recorded)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        made.clear()
        spec = get_recipe("self_forcing").build(
            _options("self_forcing", "--prepare.precision", precision), fresh=True
        )
        spec.step(spec.state, spec.data.batch(0))
        assert made and set(made) == {dtype}, (precision, made)


def test_a_streams_caches_and_contexts_are_what_the_streaming_rollout_allocates() -> None:
    from fvstep.methods.causal_rollout import rollout

    # the stream holds the sink and the window (9 frames), a step generates 3 of them
    options = _options(
        "streaming", "--prepare.precision", "bf16", "--window_frames", "6", "--sink_frames", "3",
        "--steps_per_stream", "100",
    )  # fmt: skip
    spec = get_recipe("streaming").build(options, fresh=True)
    state = spec.state
    for i in range(3):  # a full stream: the next rollout evicts
        state, _ = spec.step(state, spec.data.batch(i))
    stream = state.extra["stream"]
    assert int(stream.cache.num_frames) == 9
    live = _LiveBytes(_state_tensors(state, {}))
    with torch.no_grad(), live:
        ro = rollout(
            state.module("student"), spec.data.batch(3)["latents"].float(), stream.text,
            torch.tensor([0, 1]), exits=(1,), denoising_steps=(1.0, 0.5), cache=stream.cache,
        )  # fmt: skip
    # (a context's slots, a few indices, are not counted)
    made = live.alive(larger_than=512) - _tensor_bytes((ro.video, ro.exit_inputs))
    plan = planning.plan_run("streaming", options)
    assert plan.cache is not None
    stream_cache = _tensor_bytes((stream.cache.keys, stream.cache.values))
    assert stream.cache.keys.dtype == torch.bfloat16 and plan.cache[2] == 2
    assert stream_cache == plan.cache[0]
    # the stream's cache, the rollout's new one and its contexts' buffer (9 + 3 frames)
    assert made == plan.cache[0] * (9 + 12) / 9
    assert stream_cache + made == max(s.held for s in plan.steps)


MEASURED = [  # (recipe, flags, seconds per kind of step, peak GiB): one H200, docs/benchmarks.md
    ("finetune", ["--prepare.checkpointing", "none", "--prepare.compile_memory_budget", "0.65",
                  "--prepare.offload_activations_every", "4", "--prepare.flash_attention_4", "true"],
     (1.698,), 59.2),
    ("dmd2", ["--prepare.checkpointing", "narrow", "--prepare.offload_activations_every", "1",
              "--prepare.flash_attention_4", "true"], (2.217, 4.873), 50.1),
    ("finetune", ["--prepare.checkpointing", "full"], (2.44,), 24.7),
    ("finetune", ["--prepare.checkpointing", "selective"], (1.95,), 61.9),
    ("finetune", ["--prepare.checkpointing", "attention"], (2.08,), 27.2),
    ("dmd2", ["--prepare.checkpointing", "full"], (2.97, 6.46), 48.5),
    ("dmd2", ["--prepare.checkpointing", "selective"], (2.49, 5.49), 125.7),
    ("dmd2", ["--prepare.checkpointing", "attention"], (2.61, 5.74), 54.8),
]  # fmt: skip
REAL = ["--model.config", "examples/models/wan2.1-t2v-1.3b.json", "--data.batch_size", "1",
        "--data.latent_shape", "[16,21,60,104]", "--data.text_shape", "[512,4096]",
        "--prepare.precision", "bf16", "--prepare.compile", "true", "--optim.ema", "null"]  # fmt: skip


@pytest.mark.parametrize(("recipe", "flags", "seconds", "peak"), MEASURED)
def test_the_plan_predicts_the_measured_h200_rows_peak_within_10_and_time_within_15_percent(
    recipe: str, flags: list[str], seconds: tuple[float, ...], peak: float
) -> None:
    plan = planning.plan_run(recipe, parse_options(get_recipe(recipe), [*REAL, *flags]))
    steps = {s.name: s.seconds for s in plan.steps}
    predicted = [
        steps[k]
        for k in (["student"] if recipe == "finetune" else ["critic-only", "student+critic"])
    ]
    assert plan.peak / GIB == pytest.approx(peak, rel=0.10)
    assert predicted == pytest.approx(list(seconds), rel=0.15)


BENCHMARK_ROWS = [  # benchmarks.realshape's roles: the step under autocast (self-forcing's
    # KV cache in bf16), DiffusionNFT's old policy frozen in bf16 (planned with _benchmark)
    ("self_forcing", ["--prepare.checkpointing", "attention"], (5.605, 10.608), 63.6),
    ("diffusion_nft", ["--prepare.checkpointing", "attention", "--group_size", "2",
                       "--rollout_steps", "10", "--run.microbatches", "2"], (15.735,), 35.2),
]  # fmt: skip


@pytest.mark.parametrize(("recipe", "flags", "seconds", "peak"), BENCHMARK_ROWS)
def test_the_plan_predicts_the_self_forcing_and_diffusion_nft_rows_within_the_targets(
    recipe: str, flags: list[str], seconds: tuple[float, ...], peak: float
) -> None:
    options = parse_options(get_recipe(recipe), [*REAL, *flags])
    plan = planning.plan_run(recipe, options, _benchmark=True)
    steps = {s.name: s.seconds for s in plan.steps}
    kinds = ["student"] if recipe == "diffusion_nft" else ["critic-only", "student+critic"]
    assert plan.peak / GIB == pytest.approx(peak, rel=0.10)
    assert [steps[k] for k in kinds] == pytest.approx(list(seconds), rel=0.15)


def test_the_plan_predicts_the_streaming_row_peak_within_10_and_time_within_15_percent() -> None:
    # measured with one stream cache (docs/benchmarks.md, "Streaming's peak, traced")
    flags = ["--prepare.checkpointing", "attention", "--window_frames", "21",
             "--sink_frames", "3", "--steps_per_stream", "1000000",
             "--generator_update_interval", "2"]  # fmt: skip
    plan = planning.plan_run("streaming", parse_options(get_recipe("streaming"), [*REAL, *flags]))
    steps = {s.name: s.seconds for s in plan.steps}
    assert [steps["critic-only"], steps["student+critic"]] == pytest.approx(
        [5.711, 11.131], rel=0.15
    )
    assert plan.peak / GIB == pytest.approx(76.3, rel=0.10)


def test_the_floor_is_the_benchmarks_at_the_real_shape() -> None:
    plan = planning.plan_run("finetune", parse_options(get_recipe("finetune"), REAL))
    assert plan.steps[0].floor == pytest.approx(1.669, rel=0.03)  # benchmarks.floor, cuDNN


def test_a_run_that_does_not_fit_gets_changes_that_fit_fastest_first() -> None:
    options = parse_options(get_recipe("dmd2"), [*REAL, "--prepare.checkpointing", "none"])
    assert not planning.plan_run("dmd2", options).fits
    found = planning.suggest_changes("dmd2", options)
    assert found and all(s.plan.fits for s in found)
    times = [round(s.plan.mean_seconds, 2) for s in found]
    assert times == sorted(times)


def test_a_calibrated_kernel_table_round_trips_through_its_json(tmp_path: Any) -> None:
    shape = planning.ModelShape.of(tiny_wan())
    table = planning.calibrate_kernels(shape, device="cpu", tokens=32, repeats=1)
    path = tmp_path / "kernels.json"
    path.write_text(table.to_json())
    assert planning.load_kernel_table(str(path)) == table
    with pytest.raises(ValueError, match="neither"):
        planning.load_kernel_table(str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    "recipe", ["finetune", "dmd2", "lora_dmd2", "self_forcing", "streaming", "diffusion_nft"]
)
def test_the_command_prints_every_recipes_plan_and_exits_0_when_it_fits(
    recipe: str, capsys: Any
) -> None:
    from fvstep.cli import main

    assert main(["plan", recipe, "--run.device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out
    assert ("KV cache" in out) == (recipe in ("self_forcing", "streaming"))


def test_the_command_refuses_an_unknown_recipe_and_a_context_degree_that_cannot_be() -> None:
    from fvstep.cli import main

    assert main(["plan", "no_such_recipe"]) == 2
    assert main(["plan", "finetune", "--nproc", "2", "--context", "3"]) == 2  # not a divisor
    assert main(["plan", "self_forcing", "--nproc", "2", "--context", "2"]) == 2  # causal


def test_the_wan_shape_counted_from_a_config_is_the_module_diffusers_builds() -> None:
    from fvstep.recipes.options import ModelOptions, TinyWan

    models = [
        ModelOptions(),
        ModelOptions(tiny=TinyWan(num_layers=3, num_heads=4, dim_per_head=16, ffn_dim=48)),
        ModelOptions(config="examples/models/wan2.1-t2v-1.3b.json"),
    ]
    for model in models:
        built = planning.ModelShape.of(planning.meta_transformer(model))
        assert planning._shape_for(model) == built
    without_norm = {**planning._model_config(models[0]), "cross_attn_norm": False}
    shape = planning._wan_shape(without_norm)
    import diffusers

    with torch.device("meta"):
        module = diffusers.WanTransformer3DModel.from_config(without_norm)
    assert shape == planning.ModelShape.of(module)


def test_micro_batches_split_the_batch_and_the_optimizer_steps_once() -> None:
    one = planning.plan_run("finetune", parse_options(get_recipe("finetune"), [*REAL]))
    two = [*REAL, "--data.batch_size", "2", "--run.microbatches", "2"]
    split = planning.plan_run("finetune", parse_options(get_recipe("finetune"), two))
    # a micro-batch of one sample keeps one sample's activations, beside the first
    # micro-batch's gradients; the step runs both samples' calls, and AdamW once
    assert split.block_activations == one.block_activations
    assert split.peak == pytest.approx(
        one.peak + min(one.roles[0].gradients, one.steps[0].activations)
    )
    optimizer = one.shape.numel * 36.0 / (one.kernels.memory_bandwidth * 1e9)
    assert split.steps[0].seconds == pytest.approx(2 * one.steps[0].seconds - optimizer)


def test_context_parallel_divides_the_activations_and_the_compute_and_adds_all_to_alls() -> None:
    options = parse_options(
        get_recipe("finetune"), [*REAL, "--prepare.compile", "false", "--prepare.checkpointing", "full"]
    )  # fmt: skip
    data = planning.plan_run("finetune", options, nproc=2)
    context = planning.plan_run("finetune", options, nproc=2, context=2)
    assert context.context == 2 and "2-way context parallel" in context.format()
    assert context.block_activations == pytest.approx(data.block_activations / 2)
    assert context.steps[0].activations == pytest.approx(data.steps[0].activations / 2)
    assert [r.weights for r in context.roles] == [r.weights for r in data.roles]  # FSDP2
    # the linear layers on the text and the time run whole on each GPU
    assert context.steps[0].floor == pytest.approx(data.steps[0].floor / 2, rel=0.01)
    assert context.steps[0].seconds > data.steps[0].seconds / 2  # and the all-to-alls
    with pytest.raises(ValueError, match="eagerly"):
        planning.plan_run(
            "finetune", parse_options(get_recipe("finetune"), REAL), nproc=2, context=2
        )
    causal = parse_options(get_recipe("self_forcing"), [*REAL, "--prepare.compile", "false"])
    with pytest.raises(ValueError, match="causal"):
        planning.plan_run("self_forcing", causal, nproc=2, context=2)


def test_a_run_that_does_not_fit_on_one_node_gets_context_parallel_among_its_changes() -> None:
    options = parse_options(
        get_recipe("finetune"),
        [*REAL, "--model.config", "examples/models/wan2.1-t2v-14b.json", "--prepare.checkpointing", "none"],
    )  # fmt: skip
    assert not planning.plan_run("finetune", options, nproc=2).fits
    found = planning.suggest_changes("finetune", options, nproc=2, limit=50)
    assert any("--context" in s.change and s.plan.context > 1 for s in found)
    assert all(s.plan.fits for s in found)


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parent.parent / "examples").glob("wan2.1_*.yaml")), ids=str
)
def test_every_real_model_example_config_parses_and_fits_as_its_first_line_runs_it(
    path: Path,
) -> None:
    # the first line is the command the file documents: fvstep plan|train RECIPE --config ...
    words = path.read_text().splitlines()[0].lstrip("# ").split()
    assert words[:2] in (["fvstep", "plan"], ["fvstep", "train"]), words
    recipe, nproc = words[2], int(words[words.index("--nproc") + 1]) if "--nproc" in words else 1
    options = parse_options(get_recipe(recipe), ["--config", str(path)])
    plan = planning.plan_run(recipe, options, nproc=nproc)
    assert plan.fits, (path.name, plan.peak / GIB)
