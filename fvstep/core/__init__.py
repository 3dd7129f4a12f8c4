"""The core: steps as data, and the one engine that runs a call of a step.

See ``fvstep/core/README.md`` for what each module is and why the layering. The public
names are re-exported by the package (``fvstep.update``, ``fvstep.sequence``, ...).
"""
