"""``fvstep.recipes.planning``: the plan's bytes against a built state and measured activations,
its predictions against the measured H200 rows, and its suggestions."""

from __future__ import annotations

import contextlib
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
    [("finetune", ()), ("finetune", ("--lora.rank", "4")), ("dmd2", ()), ("lora_dmd2", ())],
    ids=["finetune", "finetune-lora", "dmd2", "lora_dmd2"],
)
def test_the_plans_bytes_per_role_equal_the_built_states_after_a_step(
    recipe: str, argv: tuple[str, ...]
) -> None:
    options = _options(recipe, *argv)
    spec = get_recipe(recipe).build(options, fresh=True)
    state, _ = spec.step(spec.state, spec.data.batch(0))
    plan = planning.plan_run(recipe, options)
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

    def alive(self) -> int:
        alive = {  # one a storage; a view of a weight is not made here
            ref.cdata: n
            for ref, n in self.made
            if not ref.expired() and ref.cdata not in self.existing
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


def test_the_command_prints_the_plan_and_exits_0_when_it_fits(capsys: Any) -> None:
    from fvstep.cli import main

    assert main(["plan", "finetune", "--run.device", "cpu"]) == 0
    assert "predicted peak" in capsys.readouterr().out
    assert main(["plan", "self_forcing"]) == 2  # not a recipe the planner knows
