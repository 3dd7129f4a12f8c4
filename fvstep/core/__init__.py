"""The core: what a state and a step are made of (each module, and why: ``README.md`` here).

The public names are re-exported by the package (``fvstep.TrainState``, ``fvstep.update``, ...).
"""
