"""The old policy's helpers (fvstep.methods.old_policy): the Euler rollout integrates the
velocity on the uniform grid, and the blend is an in-place moving average."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fvstep.methods.old_policy import blend_, euler_sample


class _Velocity(nn.Module):
    """``v(x, t) = x``, through the forward contract (it records the timesteps)."""

    def __init__(self) -> None:
        super().__init__()
        self.timesteps: list[torch.Tensor] = []

    def forward(self, *, hidden_states, timestep, encoder_hidden_states, return_dict):
        self.timesteps.append(timestep)
        return (hidden_states,)


@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_euler_sample_takes_uniform_steps_from_t1_to_0(num_steps: int) -> None:
    """With ``v = x`` each step multiplies by ``1 - 1/n``: ``x0 = (1 - 1/n)^n noise``, the
    velocity read at ``1000 t`` for ``t = 1, 1 - 1/n, ..., 1/n``."""
    module = _Velocity()
    noise = torch.randn(2, 4, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    x0 = euler_sample(module, noise, torch.zeros(2, 3, 8), num_steps)
    torch.testing.assert_close(x0, (1 - 1 / num_steps) ** num_steps * noise)
    times = [float(t[0]) for t in module.timesteps]
    assert times == pytest.approx([1000 * (1 - i / num_steps) for i in range(num_steps)])
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        euler_sample(module, noise, torch.zeros(2, 3, 8), 0)


def test_blend_is_an_in_place_moving_average() -> None:
    target = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}
    ptr = target["w"].data_ptr()
    blend_(target, {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor([7])}, 0.75)
    assert target["w"].data_ptr() == ptr
    torch.testing.assert_close(target["w"], torch.tensor([1.5, 2.5]))
    assert int(target["n"]) == 3  # integer tensors are not blended
    with pytest.raises(ValueError, match="different parameters"):
        blend_(target, {"v": torch.zeros(2)}, 0.5)
