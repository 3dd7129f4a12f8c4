"""A user's method whose resume is exact: `fvstep verify-resume examples.resume_ok:factory`.

The factory builds everything anew on each call, as a restarted process would.
"""

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.methods import flow_matching_loss
from fvstep.methods.models import synthetic_batch, tiny_wan


def factory():
    module = tiny_wan(seed=0)
    if fsp.rank_and_world()[1] > 1:  # under torchrun: shard it, so the ranks train one model
        module = fsp.shard_module(module, mesh=fsp.make_mesh())
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3), ema=fs.EMA(0.99))},
        key=fs.random.key(0),
    )
    step = fs.compile(
        fs.update("student", flow_matching_loss(t_sampling="logit_normal")),
        accumulation=fs.Accumulation(microbatches=2),
        clip=fs.clip_grad_norm(1.0),
    )
    data_key = fs.random.key(1)

    def data(step: int):  # a pure function of the step
        return synthetic_batch(fs.random.fold_in(data_key, step), batch_size=4)

    return state, step, data
