"""The executor: the loop over steps, and what a run holds beside its state.

:mod:`~fvstep.executor.loop` (``fvstep.run``), the run's checkpoints
(:mod:`~fvstep.executor.checkpoints`), data as a function of the step
(:mod:`~fvstep.executor.data`, :mod:`~fvstep.executor.latents`), what a run reports
(:mod:`~fvstep.executor.reporting`, :mod:`~fvstep.executor.trackers`,
:mod:`~fvstep.executor.media`) and the check of its schedules
(:mod:`~fvstep.executor.schedule_check`).
"""
