"""Validation: a pure function of the state, run by the executor at a cadence.

Laws: validation never changes the state, the training RNG or the checkpoint (a run with
validation equals one without, bitwise; an interrupted-and-resumed run with validation
equals an uninterrupted one, bitwise); the validation loss is the same number at the same
step in an uninterrupted and a resumed run; modules and the global RNG are restored;
sharded roles validate on every rank and are left at rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fvstep as fs
from fvstep.core import tree
from fvstep.executor.reporting import Validation
from fvstep.executor.validation import role_module, validation_loss
from fvstep.methods.finetune import add_noise, finetune
from fvstep.methods.models import predict, synthetic_batch, tiny_wan
from fvstep.testing import CrashAt, SimulatedCrash

pytest.importorskip("diffusers")


def setup(*, ema: bool = True) -> tuple[fs.TrainState, fs.Step]:
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                tiny_wan(seed=0),
                optimizer=fs.optim.adamw(lr=1e-3),
                ema=fs.EMA(0.9) if ema else None,
            )
        },
        key=fs.random.key(0),
    )
    return state, fs.compile(finetune())


def data(step: int) -> dict[str, torch.Tensor]:
    return synthetic_batch(fs.random.fold_in(fs.random.key(1), step), batch_size=2)


HELD = synthetic_batch(fs.random.key(7), batch_size=2)


def validations() -> list[Validation]:
    def global_rng_draw(state, key):
        # a validation that draws from the global RNG (as dropout would): seeded from key
        return {"draw": torch.rand(()).item()}

    return [
        Validation(validation_loss(HELD["latents"], HELD["text"]), every=2),
        Validation(
            validation_loss(HELD["latents"], HELD["text"], weights="ema"), every=3, prefix="ema"
        ),
        Validation(global_rng_draw, every=2, prefix="rng"),
    ]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def val_rows(path: Path) -> list[dict]:
    return [r for r in rows(path) if any(k.startswith(("val/", "ema/", "rng/")) for k in r)]


def test_validation_changes_nothing_and_resume_is_bitwise_with_validation_on(tmp_path):
    state, step = setup()
    plain = tree.clone(fs.run(step, state, data, num_steps=4, progress=False))

    rng_before = torch.get_rng_state()
    state, step = setup()
    ckpt_a = fs.Checkpoints(tmp_path / "a", every=2, keep=None)
    validated = fs.run(
        step,
        state,
        data,
        num_steps=4,
        checkpoints=ckpt_a,
        validation=validations(),
        progress=False,
        trackers=[],
    )
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is restored
    tree.assert_trees_equal(validated, plain, check_static=False)

    ckpt_b = fs.Checkpoints(tmp_path / "b", every=2, keep=None)
    state, step = setup()
    with pytest.raises(SimulatedCrash):
        fs.run(
            step,
            state,
            CrashAt(data, 3),
            num_steps=4,
            checkpoints=ckpt_b,
            validation=validations(),
            progress=False,
            trackers=[],
        )
    state, step = setup()
    resumed = fs.run(
        step,
        state,
        data,
        num_steps=4,
        checkpoints=ckpt_b,
        validation=validations(),
        progress=False,
        trackers=[],
    )
    tree.assert_trees_equal(resumed, plain, check_static=False)
    for s in (2, 4):  # the checkpoints themselves are those of a run without validation
        a = fs.checkpoint.load(fs.checkpoint.checkpoint_dir(ckpt_a.dir, s), like=setup()[0])
        b = fs.checkpoint.load(fs.checkpoint.checkpoint_dir(ckpt_b.dir, s), like=setup()[0])
        tree.assert_trees_equal(a, b, check_static=False)

    # the same validation numbers at the same steps, the resumed one recomputed at its start
    uninterrupted = val_rows(ckpt_a.dir / "metrics.jsonl")
    assert uninterrupted == val_rows(ckpt_b.dir / "metrics.jsonl")
    assert [r["step"] for r in uninterrupted] == [0, 0, 0, 2, 2, 3, 4, 4, 4]
    assert rows(ckpt_a.dir / "metrics.jsonl") == rows(ckpt_b.dir / "metrics.jsonl")
    draws = [r["rng/draw"] for r in uninterrupted if "rng/draw" in r]
    assert len(set(draws)) == len(draws)  # the key is folded with the step


def test_validation_loss_is_the_flow_matching_loss_at_fixed_noise_and_times():
    state, _ = setup(ema=False)
    fn = validation_loss(
        HELD["latents"], HELD["text"], timesteps=(0.25, 0.75), key=fs.random.key(3)
    )
    out = fn(state, fs.random.key(0))
    again = fn(state, fs.random.key(99))  # the key given is not used: the noise is fixed
    assert torch.equal(out["loss"], again["loss"])
    x0, text = HELD["latents"], HELD["text"]
    expected = []
    for i, t in enumerate((0.25, 0.75)):
        eps = torch.randn(
            x0.shape, generator=fs.random.generator(fs.random.fold_in(fs.random.key(3), i))
        )
        tt = torch.full((2,), t)
        with torch.no_grad():
            v = predict(state.module("student"), add_noise(x0, eps, tt), tt * 1000, text)
        expected.append(torch.nn.functional.mse_loss(v, eps - x0))
    torch.testing.assert_close(out["loss_t0.25"], expected[0])
    torch.testing.assert_close(out["loss_t0.75"], expected[1])
    torch.testing.assert_close(out["loss"], (expected[0] + expected[1]) / 2)
    chunked = validation_loss(
        HELD["latents"], HELD["text"], timesteps=(0.25, 0.75), key=fs.random.key(3), batch_size=1
    )(state, fs.random.key(0))
    torch.testing.assert_close(chunked["loss"], out["loss"])


def test_role_module_with_ema_computes_with_the_average_and_restores_the_params_bitwise():
    state, step = setup()
    for s in range(2):
        state, _ = step(state, data(s))
    before = tree.clone(state)
    ema = state.roles["student"].ema
    with role_module(state, "student", weights="ema") as module:
        live = dict(module.named_parameters())
        for name, average in ema.params.items():
            assert torch.equal(live[name], average.to(live[name].dtype))
        assert not torch.equal(live[name], before.roles["student"].params[name])
    tree.assert_trees_equal(state, before)
    no_ema = setup(ema=False)[0]
    with pytest.raises(ValueError, match="no EMA"), role_module(no_ema, "student", weights="ema"):
        pass


def test_role_module_restores_the_params_when_the_body_raises():
    state, step = setup()
    state, _ = step(state, data(0))
    before = tree.clone(state)
    with pytest.raises(RuntimeError, match="boom"), role_module(state, "student", weights="ema"):
        raise RuntimeError("boom")
    tree.assert_trees_equal(state, before)


def test_validation_runs_in_eval_mode_without_grad_and_restores_modes():
    state, step = setup(ema=False)
    seen = {}

    def probe(state, key):
        module = state.module("student")
        seen["training"] = module.training
        seen["grad"] = torch.is_grad_enabled()
        return {}

    final = fs.run(
        step, state, data, num_steps=1, validation=Validation(probe), progress=False, trackers=[]
    )
    assert seen == {"training": False, "grad": False}
    assert final.module("student").training


def test_due_cadence_and_refusals():
    v = Validation(lambda s, k: {}, every=3, at_start=True, at_end=True)
    assert [s for s in range(11) if v.due(s, start=4, num_steps=10)] == [0, 3, 4, 6, 9, 10]
    assert not Validation(lambda s, k: {}, at_end=False).due(5, start=0, num_steps=5)
    with pytest.raises(ValueError, match="every"):
        Validation(lambda s, k: {}, every=0)
    state, step = setup()
    with pytest.raises(TypeError, match="Validation"):
        fs.run(step, state, data, num_steps=1, validation=[lambda s, k: {}])
    with pytest.raises(TypeError, match="mapping"):
        fs.run(step, state, data, num_steps=1, validation=Validation(lambda s, k: 1.0))


# --- 2 FSDP2-sharded ranks ----------------------------------------------------------------


def check_sharded_validation(rank: int, world_size: int, directory: str):
    import warnings

    from fvstep import parallel as fsp
    from fvstep.parallel.grad_sync import unrested_modules

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    def sharded_setup():
        mesh = fsp.make_mesh(device_type="cpu")
        state = fs.TrainState.create(
            {
                "student": fs.Role(
                    fsp.shard_module(tiny_wan(seed=0), mesh=mesh),
                    optimizer=fs.optim.adamw(lr=1e-3),
                    ema=fs.EMA(0.9),
                )
            },
            key=fs.random.key(0),
        )
        return state, fs.compile(finetune())

    state, step = sharded_setup()
    plain = tree.clone(fs.run(step, state, data, num_steps=2, progress=False))
    state, step = sharded_setup()
    v = [
        Validation(validation_loss(HELD["latents"], HELD["text"], weights="ema"), every=1),
    ]
    validated = fs.run(
        step,
        state,
        data,
        num_steps=2,
        validation=v,
        progress=False,
        trackers=[],
        metrics_path=Path(directory) / "m.jsonl",
    )
    tree.assert_trees_equal(validated, plain, check_static=False)
    return unrested_modules(validated)


@pytest.mark.heavy
@pytest.mark.multirank
def test_sharded_validation_runs_on_every_rank_logs_once_and_leaves_modules_at_rest(
    ranks, tmp_path
):
    assert ranks.run(check_sharded_validation, str(tmp_path)) == [[], []]
    logged = [r for r in rows(tmp_path / "m.jsonl") if "val/loss" in r]
    assert [r["step"] for r in logged] == [0, 1, 2]
    losses = [r["val/loss"] for r in logged]
    assert len(set(losses)) == len(losses)  # the EMA moves
