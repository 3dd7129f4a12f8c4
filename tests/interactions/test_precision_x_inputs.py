"""Frozen low precision × the model's inputs × preparation: a role that ``prepare`` holds
in bf16 (``trainable=False``) casts activations at its boundary, never its timesteps,
whatever their shape (per-sample ``(B,)`` or per-token ``(B, S)``, Wan2.2 TI2V style),
passed by keyword or by position, with or without checkpointing and compile.

The reference is the same bf16 module's own ``forward`` (no boundary hooks), given bf16
activations and the fp32 timesteps: the boundary must add nothing but the two casts.
"""

from __future__ import annotations

import pytest
import torch

from fvstep import parallel as fsp
from fvstep.core.random import key
from fvstep.methods.models import synthetic_batch, tiny_wan

BATCH = synthetic_batch(key(3), batch_size=2)
TOKENS = 2 * 2 * 2  # frames × (H / 2) × (W / 2): the tiny Wan's patch is (1, 2, 2)
# Timesteps that bf16 rounds (999 -> 1000, 501 -> 500): the cells cannot pass by luck.
PER_SAMPLE = torch.tensor([999.0, 501.0])
PER_TOKEN = torch.linspace(501.0, 999.0, TOKENS).repeat(2, 1)

PREPARATIONS = {
    "plain": {},
    "full": {"checkpointing": "full"},
    "compile": {"compile": {"backend": "aot_eager"}},
}
TIMESTEPS = {"per_sample": PER_SAMPLE, "per_token": PER_TOKEN}


def frozen(options: dict) -> torch.nn.Module:
    if "compile" in options:
        torch._dynamo.reset()
    return fsp.prepare(tiny_wan(seed=0), trainable=False, **options)


def unhooked(module: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = module.forward(
            hidden_states=BATCH["latents"].bfloat16(),
            timestep=t,
            encoder_hidden_states=BATCH["text"].bfloat16(),
            return_dict=False,
        )[0]
    return out.float()


@pytest.mark.parametrize("call", ["keyword", "positional"])
@pytest.mark.parametrize("timesteps", sorted(TIMESTEPS))
@pytest.mark.parametrize("prep", sorted(PREPARATIONS))
def test_a_frozen_bf16_role_keeps_its_timesteps_in_full_precision(prep, timesteps, call):
    module = frozen(PREPARATIONS[prep])
    assert bf16_rounds(TIMESTEPS[timesteps])
    t = TIMESTEPS[timesteps]
    x, text = BATCH["latents"], BATCH["text"]
    with torch.no_grad():
        if call == "keyword":
            out = module(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)
        else:
            out = module(x, t, text, None, False)
    assert out[0].dtype == torch.float32  # cast back to the caller's dtype
    assert torch.equal(out[0], unhooked(module, t))


def bf16_rounds(t: torch.Tensor) -> bool:
    return not torch.equal(t.bfloat16().float(), t)


def test_an_argument_named_by_the_caller_keeps_its_precision():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        def forward(self, x, noise_level):
            return self.blocks[0](x) * 0 + noise_level

    level = torch.full((2, 4), 999.0)
    default = fsp.prepare(Net(), trainable=False)
    named = fsp.prepare(
        Net(), trainable=False, full_precision_inputs=(*fsp.FULL_PRECISION_INPUTS, "noise_level")
    )
    with torch.no_grad():
        assert default(torch.ones(2, 4), level).max().item() == 1000.0  # rounded, as asked
        assert torch.equal(named(torch.ones(2, 4), level), level)
    with pytest.raises(TypeError, match="collection of argument names"):
        fsp.prepare(Net(), trainable=False, full_precision_inputs="noise_level")


class Wrapper(torch.nn.Module):
    """A user's role: the forward contract around a diffusers model it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_wan(seed=0)
        self.blocks = self.net.blocks  # the blocks prepare would checkpoint or compile

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        return self.net(
            hidden_states=hidden_states,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            return_dict=return_dict,
        )


def test_a_frozen_wrapper_keeps_the_fp32_modules_of_the_model_inside_it():
    direct = fsp.prepare(tiny_wan(seed=0), trainable=False)
    wrapped = fsp.prepare(Wrapper(), trainable=False)
    dtypes = {n: p.dtype for n, p in direct.named_parameters()}
    assert torch.float32 in dtypes.values() and torch.bfloat16 in dtypes.values()
    assert {n.removeprefix("net."): p.dtype for n, p in wrapped.net.named_parameters()} == dtypes
    with torch.no_grad():
        args = (BATCH["latents"], PER_TOKEN, BATCH["text"])
        assert torch.equal(wrapped(*args)[0], direct(*args)[0])


def test_a_frozen_role_returns_the_output_type_of_its_model():
    module = frozen({})
    with torch.no_grad():
        out = module(
            hidden_states=BATCH["latents"],
            timestep=PER_SAMPLE,
            encoder_hidden_states=BATCH["text"],
            return_dict=True,
        )
    assert type(out).__name__ == "Transformer2DModelOutput"
    assert out.sample.dtype == torch.float32 and torch.equal(out[0], out.sample)
    assert torch.equal(out.sample, unhooked(module, PER_SAMPLE))
