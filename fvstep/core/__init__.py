"""The core: what a state and a step are made of.

The state and what is in it (:mod:`~fvstep.core.state`, :mod:`~fvstep.core.tree`,
:mod:`~fvstep.core.random`, :mod:`~fvstep.core.optim`, :mod:`~fvstep.core.schedules`, ...),
steps as data, and the one engine that runs a call of a step. See ``fvstep/core/README.md``
for what each module is and why the layering. The public names are re-exported by the
package (``fvstep.TrainState``, ``fvstep.update``, ``fvstep.optim``, ...).
"""
