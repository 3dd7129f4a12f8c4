"""What a run shows: validation functions and samplers. They read the state, never change it.

:mod:`~fvstep.observe.validation` (``(state, key) -> metrics``) and
:mod:`~fvstep.observe.sampling` (flow-matching samplers, VAE decoding, sample videos).
"""
