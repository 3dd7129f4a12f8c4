"""Reference training methods, written against fvstep's public API.

Every method calls its roles' modules through the forward contract of
:mod:`fvstep.methods.models`, so any ``nn.Module`` with that signature works, not only
``diffusers`` models. Each method has its page under ``docs/methods/`` or
``docs/concepts/composition.md``.
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
