"""Weights × FSDP2 options × observers, on 2 gloo ranks: validation with the EMA right
after a forward with the live weights (the sequence that read live weights once), the
exports of the sharded role, and the compute-dtype cast of a sharded role × timesteps.

One rank function runs every cell (ranks are costly to spawn) and returns a row per
cell; the test asserts each row. Bitwise: an FSDP2 forward with gathered parameters runs
the same arithmetic as the unsharded module with the same weights, on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.interactions.cells import PROBE, WEIGHTS, Preparation, build_state, train

pytest.importorskip("diffusers")
pytest.importorskip("peft")

SHARDINGS = {
    "prepare": {},
    "prepare_keep_gathered": {"reshard_after_forward": False},
    "prepare_full_ac": {"checkpointing": "full"},
}
"""FSDP2 options of ``prepare`` crossed with the weights, plus a hand-written
``fully_shard`` (blocks, then the root) in the rank function."""

CASES = ("ema_before_start", "ema_after_start", "lora_ema_after_start")


def validation_pair(state):
    """Live loss, then the EMA loss: what a user's validation function does."""
    from fvstep.executor.validation import validation_loss

    live = validation_loss(PROBE["latents"], PROBE["text"])(state, None)["loss"]
    ema = validation_loss(PROBE["latents"], PROBE["text"], weights="ema")(state, None)["loss"]
    return live, ema


def reference_losses(state, case):
    import fvstep as fs
    from fvstep.executor.validation import validation_loss
    from tests.interactions.cells import reference_module

    out = []
    for weights in ("params", "ema"):
        ref = fs.TrainState.create(
            {"student": fs.Role(reference_module(state, case, weights))}, key=fs.random.key(0)
        )
        out.append(validation_loss(PROBE["latents"], PROBE["text"])(ref, None)["loss"])
    return out


def check_cells(rank: int, world_size: int) -> list[tuple[str, str, float]]:
    import warnings

    from torch.distributed.fsdp import fully_shard

    from fvstep import parallel as fsp
    from fvstep.checkpoint import gather_weights
    from fvstep.parallel.grad_sync import unrested_modules
    from tests.interactions.cells import expected_weights

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = fsp.make_mesh(device_type="cpu")

    def hand_shard(module):
        for block in module.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module

    rows = []
    for case in (c for c in WEIGHTS if c.name in CASES):
        layouts = {name: dict(prep=Preparation(name, opts)) for name, opts in SHARDINGS.items()}
        if not case.lora:
            layouts["hand_fully_shard"] = dict(prep=Preparation("none"), shard=hand_shard)
        for layout, how in layouts.items():
            prep = how["prep"]
            if "shard" in how:
                state = train(build_state(case, prep, shard=how["shard"]))
            else:
                state = train(build_state(case, prep, mesh=mesh))
            cell = f"{case.name}-{layout}"
            live, ema = validation_pair(state)
            want_live, want_ema = reference_losses(state, case)
            tol = 1e-6 if case.lora else 0.0  # LoRA vs its merge: rounding of the order
            rows.append((cell, "validation live", abs(live.item() - want_live.item()) - tol))
            rows.append((cell, "validation ema", abs(ema.item() - want_ema.item()) - tol))
            moved = case.started != (live.item() == ema.item())
            rows.append((cell, "ema differs from live iff started", 0.0 if moved else 1.0))
            rows.append((cell, "modules at rest", float(len(unrested_modules(state)))))
            got = gather_weights(state, "student", weights="ema", rank0_only=False)
            want = expected_weights(state, case, "ema")
            diff = max((got[n] - want[n]).abs().max().item() for n in want)
            rows.append((cell, "gather_weights ema", diff))
    return rows


@pytest.mark.multirank
def test_sharded_observers_read_the_weights_the_leaves_say(ranks):
    results = ranks.run(check_cells)
    assert results[0] == results[1]  # every rank computes the same numbers
    bad = [row for row in results[0] if row[2] > 0.0]
    assert not bad, bad
    assert len(results[0]) == 5 * (3 * len(CASES) + 2)


def check_compute_dtype_cast(rank: int, world_size: int) -> list[str]:
    """``prepare(mesh, param_dtype=bf16)``: the timestep reaches the model in fp32, by
    keyword (a Wan) and by position (a LoRA role over a frozen base)."""
    from fvstep import parallel as fsp
    from fvstep.methods.models import tiny_wan

    mesh = fsp.make_mesh(device_type="cpu")
    seen = []
    module = fsp.prepare(tiny_wan(seed=0), mesh=mesh, param_dtype=torch.bfloat16)
    module.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(str(kwargs["timestep"].dtype)), with_kwargs=True
    )
    x, text = PROBE["latents"], PROBE["text"]
    for t in (torch.tensor([999.0, 501.0]), torch.full((2, 8), 999.0)):
        module(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)

    # A LoRA role computing in bf16 over a frozen base, called by position: its forward
    # is (*args, **kwargs), named by the base's signature (fvstep.methods.lora.LoRAModule).
    import peft

    from fvstep.methods.lora import add_adapters

    base = tiny_wan(seed=0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"])
    lora = add_adapters(base, {"student": config})["student"]
    fsp.prepare(base, mesh=mesh, trainable=False)
    fsp.prepare(lora, mesh=mesh, param_dtype=torch.bfloat16)
    base.condition_embedder.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(str(args[0].dtype)), with_kwargs=True
    )
    for t in (torch.tensor([999.0, 501.0]), torch.full((2, 8), 999.0)):
        lora(x, t, text, None, False)
    return seen


@pytest.mark.multirank
def test_a_sharded_bf16_compute_role_keeps_per_token_timesteps_in_fp32(ranks):
    assert ranks.run(check_compute_dtype_cast) == [["torch.float32"] * 4] * 2
