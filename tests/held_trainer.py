"""``fvstep train ...`` that a test preempts at a known step: the subject of the
kill-and-resume law in ``test_cli_train.py``.

``python tests/held_trainer.py HOLD_AT MARKER fvstep-argv...`` runs ``fvstep.cli.main`` on
the given arguments (``train finetune --config ...``), unchanged, except that the batch of
step ``HOLD_AT`` is handed over only once this process has received SIGTERM: before
waiting it writes ``MARKER``, so that the test knows when to signal the process group, and
nothing sleeps to synchronise. ``fvstep.run`` then finishes step ``HOLD_AT``, saves
``step_{HOLD_AT + 1}`` and raises ``fvstep.Interrupted``; the command exits 75. The exit
code is the command's.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

WAIT_S = 300.0


class Held:
    """A data source whose batch of step ``at`` waits for SIGTERM."""

    def __init__(self, data, at: int, marker: str, wakeup: int) -> None:
        self.data, self.at, self.marker, self.wakeup = data, at, marker, wakeup

    def batch(self, step, *, rank=0, world_size=1):
        if int(step) == self.at:
            Path(self.marker).write_text(str(os.getpid()))
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                ready, _, _ = select.select([self.wakeup], [], [], 1.0)
                if ready and signal.SIGTERM in os.read(self.wakeup, 512):
                    break
            else:
                raise TimeoutError(f"no SIGTERM within {WAIT_S:.0f} s")
        return self.data.batch(step, rank=rank, world_size=world_size)

    def close(self) -> None:
        close = getattr(self.data, "close", None)
        if close is not None:
            close()


def main() -> int:
    at, marker, *argv = sys.argv[1:]
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)  # the executor's SIGTERM handler is a Python one

    from fvstep.cli import main as fvstep_main
    from fvstep.recipes import parts

    make_data = parts.make_data
    parts.make_data = lambda options, **kw: Held(
        make_data(options, **kw), int(at), marker, wakeup_r
    )
    return fvstep_main(argv)


if __name__ == "__main__":
    sys.exit(main())
