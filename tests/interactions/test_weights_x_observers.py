"""Weights × preparation × observers, on one process: every way of reading a role's
weights back out (validation's ``role_module``, ``validation_loss``, ``gather_weights``,
``export`` as ``"safetensors"`` and ``"diffusers"``, LoRA's ``merge_weights`` and the
``"merged"`` export) computes with the same weights, the ones an independent reading of the
state's leaves says (:func:`tests.interactions.cells.expected_weights`), for live weights,
an EMA before and after its ``start_step``, LoRA and tied weights, and every preparation.

Bitwise where both sides run the same arithmetic; a LoRA role against its merged model
differs by the rounding of ``W x + s B (A x)`` against ``(W + s B A) x`` (stated below).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fvstep as fs
from fvstep.checkpoint.exporting import export, gather_weights
from fvstep.executor.validation import role_module, validation_loss
from fvstep.methods.models import tiny_wan
from tests.interactions.cells import (
    PREPARATIONS,
    PROBE,
    WEIGHTS,
    Preparation,
    WeightsCase,
    build_state,
    reference_module,
    tie,
    train,
    velocity,
)

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

LORA_RTOL = 1e-5
"""LoRA role against its merge: fp32 rounding of two association orders, relative to the
largest velocity."""


@functools.cache
def trained(case_name: str, prep_name: str) -> fs.TrainState:
    case = next(c for c in WEIGHTS if c.name == case_name)
    prep = next(p for p in PREPARATIONS if p.name == prep_name)
    if prep.options and "compile" in prep.options:
        # Every compiled tiny Wan adds graphs to the blocks' one code object; start afresh
        # so that this matrix never meets dynamo's recompile limit.
        torch._dynamo.reset()
    return train(build_state(case, prep))


def assert_same_velocity(got: torch.Tensor, want: torch.Tensor, case: WeightsCase) -> None:
    if case.lora:
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= LORA_RTOL * scale, "LoRA vs its merge"
    else:
        assert torch.equal(got, want), f"max diff {(got - want).abs().max().item():.3g}"


def weights_of(case: WeightsCase) -> list[str]:
    return ["params"] if case.ema_start is None else ["params", "ema"]


def load_plain(tensors: dict[str, torch.Tensor], case: WeightsCase) -> torch.nn.Module:
    module = tiny_wan(seed=5)
    if case.tied:
        tie(module)
    module.load_state_dict(tensors)
    return module


# observers: (state, case, weights, tmp) -> velocity on the probe


def via_role_module(state, case, weights, tmp):
    with role_module(state, "student", weights=weights) as net:
        return velocity(net)


def via_gather_weights(state, case, weights, tmp):
    return velocity(load_plain(gather_weights(state, "student", weights=weights), case))


def via_export_role(state, case, weights, tmp):
    path = export(state, "student", tmp / "role", weights=weights)
    return velocity(load_plain(load_file(path), case))


def via_export_diffusers(state, case, weights, tmp):
    from tests.test_export import load_diffusers

    export(state, "student", tmp / "diffusers", weights=weights, format="diffusers")
    return velocity(load_diffusers(tmp / "diffusers"))


def via_merge_weights(state, case, weights, tmp):
    from fvstep.checkpoint import merge_weights

    return velocity(load_plain(merge_weights(state, "student", weights=weights), case))


def via_export_merged(state, case, weights, tmp):
    from tests.test_export import load_diffusers

    export(state, "student", tmp / "merged", weights=weights, format="merged")
    return velocity(load_diffusers(tmp / "merged"))


OBSERVERS = {
    "role_module": via_role_module,
    "gather_weights": via_gather_weights,
    "export_role": via_export_role,
    "export_diffusers": via_export_diffusers,
    "merge_weights": via_merge_weights,
    "export_merged": via_export_merged,
}
"""The columns: every reader of a role's weights. A new exporter joins here."""

# A LoRA role's own weights are its adapter: it is read out whole by a merge; the plain
# exporters of a tied role load back non-strictly only (diffusers refuses the tie).
LORA_ONLY = {"merge_weights", "export_merged"}
PLAIN_ONLY = {"gather_weights", "export_role", "export_diffusers"}


def applies(observer: str, case: WeightsCase) -> bool:
    if case.lora:
        return observer not in PLAIN_ONLY
    if case.tied and observer == "export_diffusers":
        return False
    return observer not in LORA_ONLY


CELLS = [
    pytest.param(case, observer, id=f"{case.name}-{observer}")
    for case in WEIGHTS
    for observer in OBSERVERS
    if applies(observer, case)
]


@pytest.mark.parametrize(("case", "observer"), CELLS)
def test_every_observer_computes_with_the_weights_the_leaves_say(case, observer, tmp_path):
    state = trained(case.name, "none")
    for weights in weights_of(case):
        got = OBSERVERS[observer](state, case, weights, tmp_path / weights)
        assert_same_velocity(got, velocity(reference_module(state, case, weights)), case)


@pytest.mark.parametrize("case", [c for c in WEIGHTS if c.ema_start], ids=lambda c: c.name)
def test_the_ema_is_the_live_weights_exactly_until_it_starts(case):
    """The cells above cannot pass vacuously: an EMA that started differs from the live
    weights, one that did not is them, bit for bit."""
    state = trained(case.name, "none")
    live = velocity(reference_module(state, case, "params"))
    ema = velocity(reference_module(state, case, "ema"))
    assert torch.equal(live, ema) != case.started
    with role_module(state, "student", weights="params") as net:
        live = velocity(net)
    with role_module(state, "student", weights="ema") as net:
        assert torch.equal(velocity(net), live) != case.started


@pytest.mark.parametrize("case", WEIGHTS[:3], ids=lambda c: c.name)
def test_validation_loss_with_ema_weights_is_the_loss_of_the_expected_weights(case):
    fn = validation_loss(
        PROBE["latents"], PROBE["text"], weights="ema" if case.ema_start else "params"
    )
    state = trained(case.name, "none")
    got = fn(state, fs.random.key(0))["loss"]
    reference = fs.TrainState.create(
        {"student": fs.Role(reference_module(state, case, "ema" if case.ema_start else "params"))},
        key=fs.random.key(0),
    )
    want = validation_loss(PROBE["latents"], PROBE["text"])(reference, fs.random.key(0))["loss"]
    assert torch.equal(got, want)


PREPARED_CASES = [
    c for c in WEIGHTS if c.name in ("ema_before_start", "ema_after_start", "lora_ema_after_start")
]


PREPARED_CELLS = [
    pytest.param(case, prep, observer, id=f"{case.name}-{prep.name}-{observer}")
    for case in PREPARED_CASES
    for prep in PREPARATIONS[1:]
    for observer in ("role_module", "gather_weights", "export_diffusers", "merge_weights")
    if applies(observer, case)
]


@pytest.mark.parametrize(("case", "prep", "observer"), PREPARED_CELLS)
def test_observers_agree_on_prepared_modules(
    case: WeightsCase, prep: Preparation, observer: str, tmp_path: Path
) -> None:
    """Preparation never changes which weights an observer reads (nor its parameter
    names): checkpointing (full, selective, every 2nd block) and compile (aot_eager)."""
    state = trained(case.name, prep.name)
    for weights in weights_of(case):
        got = OBSERVERS[observer](state, case, weights, tmp_path / weights)
        assert_same_velocity(got, velocity(reference_module(state, case, weights)), case)


def test_inside_an_ema_block_readers_of_the_live_weights_refuse(tmp_path):
    """Inside ``role_module(weights="ema")`` the parameters are the EMA: a save, an export
    or a nested read of the live weights would take it for them, so each refuses; after
    the block they work and see the live weights."""
    case = next(c for c in WEIGHTS if c.name == "ema_after_start")
    state = trained(case.name, "none")
    before = fs.tree.clone(state)
    with role_module(state, "student", weights="ema"):
        with pytest.raises(fs.checkpoint.CheckpointError, match="hold their EMA"):
            fs.checkpoint.save(state, tmp_path / "inside")
        saver = fs.checkpoint.AsyncSaver()
        with pytest.raises(fs.checkpoint.CheckpointError, match="hold their EMA"):
            saver.save(state, tmp_path / "inside")
        saver.close()
        with pytest.raises(ValueError, match="holds its EMA"):
            export(state, "student", tmp_path / "inside.safetensors")
        with pytest.raises(ValueError, match="holds its EMA"):
            gather_weights(state, "student")
        with (
            pytest.raises(ValueError, match="inside a role_module block"),
            role_module(state, "student", weights="params"),
        ):
            pass
        assert not (tmp_path / "inside").exists()
    fs.checkpoint.save(state, tmp_path / "after")
    loaded = fs.checkpoint.load(tmp_path / "after", like=build_state(case))
    fs.tree.assert_trees_equal(loaded, before, check_static=False)
