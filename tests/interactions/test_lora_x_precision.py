"""LoRA merge × the base's storage dtype × the requested dtype × live/EMA weights.

``prepare`` holds a frozen base in bf16 by default. A trained adapter's change to a weight
is mostly far below an ulp of that weight in bf16: a merge that rounds to the base's
dtype before the requested one loses it. The merge is computed in fp32 and cast once.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fvstep as fs
import fvstep.checkpoint
from fvstep import parallel as fsp
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import tiny_wan
from tests.interactions.cells import data, full, velocity

peft = pytest.importorskip("peft")
from fvstep.checkpoint import merge_weights  # noqa: E402
from fvstep.methods.lora import add_adapters  # noqa: E402

SCALING = 8 / 4  # lora_alpha / r


@functools.cache
def trained(base_dtype: str) -> fs.TrainState:
    """A LoRA student over a frozen base stored in ``base_dtype``, 3 steps at a small
    learning rate (the adapter's B starts at zero, as peft initialises it)."""
    base = tiny_wan(seed=0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "ffn.net.2"])
    student = add_adapters(base, {"student": config}, seed=3)["student"]
    frozen_dtype = None if base_dtype == "float32" else getattr(torch, base_dtype)
    fsp.prepare(base, trainable=False, frozen_dtype=frozen_dtype)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                student, optimizer=fs.optim.adamw(lr=1e-4), ema=fs.EMA(0.5, start_step=1)
            ),
            "base": fs.Role(base, save_frozen=False),
        },
        key=fs.random.key(0),
    )
    step = fs.compile(fs.update("student", flow_matching_loss()))
    for i in range(3):
        state, _ = step(state, data(i))
    return state


def merged_by_hand(state: fs.TrainState, weights: str) -> dict[str, torch.Tensor]:
    """``W + s·B@A`` in fp32 for the adapted weights, every tensor in fp32."""
    rs = state.role("student")
    adapter = {n: full(p) for n, p in rs.params.items()}
    if weights == "ema":
        assert rs.ema is not None and bool(rs.ema.initialized)
        adapter.update({n: full(p) for n, p in rs.ema.params.items()})
    out = {}
    for name, w in ((n, full(p)) for n, p in state.role("base").params.items()):
        path = name.removesuffix(".base_layer.weight")
        w = w.float()
        if f"{path}.lora_A.weight" in adapter:
            w = w + SCALING * (adapter[f"{path}.lora_B.weight"] @ adapter[f"{path}.lora_A.weight"])
        out[name.replace(".base_layer.", ".")] = w
    return out


@pytest.mark.parametrize("weights", ["params", "ema"])
@pytest.mark.parametrize("base_dtype", ["bfloat16", "float32"])
def test_a_merge_keeps_every_change_of_the_adapter(base_dtype, weights):
    state = trained(base_dtype)
    want = merged_by_hand(state, weights)
    got = merge_weights(state, "student", weights=weights)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert torch.float32 == fvstep.checkpoint.MERGED_DTYPE
    base = {n.replace(".base_layer.", "."): full(p) for n, p in state.role("base").params.items()}
    changed = [n for n in want if not torch.equal(want[n], base[n].float())]
    assert changed, "the adapter must have changed some weights for this cell to mean anything"
    # what a merge rounded to bf16 first would have lost: most of the adapted elements
    if base_dtype == "bfloat16":
        lost = sum(
            int(
                (want[n].bfloat16().float() == base[n].float())
                .logical_and(want[n] != base[n].float())
                .sum()
            )
            for n in changed
        )
        assert lost > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_merge_in_a_low_precision_dtype_rounds_once(dtype):
    state = trained("bfloat16")
    got = merge_weights(state, "student", dtype=dtype)
    want = merged_by_hand(state, "params")
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(dtype)), name


def test_the_merged_model_computes_what_the_lora_role_computes():
    """Over the bf16 base, the fp32 merge against the LoRA role (which computes the bf16
    base in bf16 and the adapter in fp32): within bf16 rounding of the base's matmuls."""
    state = trained("bfloat16")
    merged = tiny_wan(seed=9)
    merged.load_state_dict(merge_weights(state, "student"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = velocity(merged)
    want = velocity(state.module("student"))
    assert (got - want).abs().max().item() <= 5e-2 * want.abs().max().item()
