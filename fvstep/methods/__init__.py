"""Reference training methods, written against fvstep's public API.

Every method calls its roles' modules through the forward contract of
:mod:`fvstep.methods.models` (``module(hidden_states=x, timestep=1000 t,
encoder_hidden_states=text, return_dict=False)[0]`` is the flow-matching velocity), so
any ``nn.Module`` with that signature works, not only ``diffusers`` models.

- :func:`finetune` / :func:`flow_matching_loss`: flow-matching fine-tuning (one role).
- :func:`dmd2` / :func:`dmd2_losses`: DMD2 distillation (student, teacher, critic).
- :func:`rl` / :func:`rl_inner_loss`: an RL-style managed step (student, old, reference).
- :func:`diffusion_nft`: DiffusionNFT (policy, old, optional reference).
- Shared by the RL methods: rewards in :mod:`fvstep.methods.rewards`, the old policy's
  rollout and soft update in :mod:`fvstep.methods.old_policy`.
- :func:`make_causal` / :func:`causal_forward`: a block-causal Wan with a KV cache
  (:class:`KVCache`, :func:`init_cache`).
- :func:`self_forcing`: self-forcing over a causal student (student, teacher, critic).
- :func:`streaming` / :func:`init_stream`: a self-forcing stream across steps, its state
  (:class:`StreamState`) in ``TrainState.extra``.

Examples:
    >>> from fvstep.methods import dmd2
    >>> step = fvstep.compile(dmd2(generator_update_interval=5),
    ...                       accumulation=fvstep.Accumulation(microbatches=2))
"""

from fvstep.methods.causal_wan import KVCache, causal_forward, init_cache, make_causal
from fvstep.methods.diffusion_nft import SoftUpdate, diffusion_nft
from fvstep.methods.dmd2 import DMD2Losses, dmd2, dmd2_losses
from fvstep.methods.finetune import finetune, flow_matching_loss
from fvstep.methods.rl import rl, rl_inner_loss
from fvstep.methods.self_forcing import self_forcing, self_forcing_losses
from fvstep.methods.streaming import StreamState, init_stream, streaming

__all__ = [
    "DMD2Losses",
    "KVCache",
    "SoftUpdate",
    "StreamState",
    "causal_forward",
    "diffusion_nft",
    "dmd2",
    "dmd2_losses",
    "finetune",
    "flow_matching_loss",
    "init_cache",
    "init_stream",
    "make_causal",
    "rl",
    "rl_inner_loss",
    "self_forcing",
    "self_forcing_losses",
    "streaming",
]
