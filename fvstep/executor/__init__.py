"""The executor: the loop over steps (``fvstep.run``), and what a run holds beside its state.

Its checkpoints, its data as a function of the step, what it reports (validation,
trackers, media) and the check of its schedules; the modules: docs/architecture.md.
"""
