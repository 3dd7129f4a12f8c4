"""A deliberately impure method: its data reads the global RNG, unseeded.

`fvstep verify-resume examples.impure_global_rng:factory` fails and names the first leaf
that differs: the batch at step s depends on how many draws the process made before, so
the resumed run trains on other data than the uninterrupted one.
"""

import torch

import fvstep as fs
from fvstep.methods import flow_matching_loss
from fvstep.methods.models import tiny_wan


def factory():
    state = fs.TrainState.create(
        {"student": fs.Role(tiny_wan(seed=0), optimizer=fs.optim.adamw(lr=1e-3))},
        key=fs.random.key(0),
    )
    step = fs.compile(fs.update("student", flow_matching_loss()))

    def data(step: int):  # NOT a function of the step: the global RNG moves on
        return {"latents": torch.randn(2, 4, 2, 4, 4), "text": torch.randn(2, 3, 16)}

    return state, step, data
