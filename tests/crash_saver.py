"""A process that saves checkpoints in a loop until it is killed: the subject of the
crash-safety law in ``test_checkpoint.py``.

``python tests/crash_saver.py serve`` imports torch and fvstep once, then for every line
``<root>`` it reads from stdin forks one saver process (a trial then costs no import)
that

1. saves the state of step 1 completely into ``<root>``,
2. prints ``ready <pid> <seconds that save took>``,
3. saves steps 2, 3, ... (``checkpoint_dir(root, step)``), printing ``saved <step>``
   after each ``save`` returns,

until the test kills it with SIGKILL. The server reaps it and prints
``dead <pid> <signal number>`` (``exit <code>`` if it ended by itself). The state of
step ``s`` is :func:`make_state` ``(s)``, a pure function of ``s``, so the test knows
what every checkpoint must hold.

``python tests/crash_saver.py <root>`` runs one saver in the foreground (for debugging).
Run it from the repository root with ``PYTHONPATH=.`` (the test sets it).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import fvstep as fs
from fvstep import checkpoint as ckpt

WIDTH = 256
DEPTH = 8  # 8 x (256 x 256 + 256) fp32 params + AdamW moments: about 6.3 MB per checkpoint


def make_state(step: int) -> fs.TrainState:
    """The state the saver saves at ``step``: every leaf a pure function of ``step``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    state = fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3))},
        key=fs.random.key(0),
        extra={"marker": torch.tensor(0)},
    )
    fill(state, step)
    return state


def fill(state: fs.TrainState, step: int) -> None:
    """Overwrite ``state`` in place with the values of ``step``."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for x in fs.tree.leaves(state):
            if x.is_floating_point():
                x.copy_(torch.randn(x.shape, generator=gen))
        state.step.fill_(step)
        state.extra["marker"].fill_(step)


def report(line: str) -> None:
    """Write ``line`` to stdout in one ``write`` of under ``PIPE_BUF`` bytes: atomic on a
    pipe, so a SIGKILL cannot leave half a line for the server's next report to join
    (``print`` writes the text and its newline apart when stdout is unbuffered, as under
    ``PYTHONUNBUFFERED``: CI once read ``saved 3dead ...``)."""
    data = f"{line}\n".encode()
    assert len(data) < 512, line
    os.write(sys.stdout.fileno(), data)


def run_saver(root: str) -> None:
    """Save step 1, print ``ready``, then save steps 2, 3, ... forever."""
    state = make_state(1)
    start = time.perf_counter()
    ckpt.save(state, ckpt.checkpoint_dir(root, 1))
    report(f"ready {os.getpid()} {time.perf_counter() - start:.4f}")
    step = 2
    while True:
        fill(state, step)
        ckpt.save(state, ckpt.checkpoint_dir(root, step))
        report(f"saved {step}")
        step += 1


def serve() -> None:
    """Fork one saver per root read from stdin; report how each one ended."""
    for line in sys.stdin:
        root = line.strip()
        if not root:
            continue
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_saver(root)
            except BaseException as e:
                print(f"error {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            report(f"dead {pid} {os.WTERMSIG(status)}")
        else:
            report(f"exit {pid} {os.WEXITSTATUS(status)}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:] == ["serve"]:
        serve()
    elif len(sys.argv) == 2:
        run_saver(sys.argv[1])
    else:
        sys.exit("usage: crash_saver.py serve | crash_saver.py <root>")
