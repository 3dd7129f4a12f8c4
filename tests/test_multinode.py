"""Several nodes, as far as one machine allows: two ``torchrun`` agents on this host.

Each agent is started as a node would be (``--nnodes 2 --nproc-per-node 1``, a c10d
rendezvous on a localhost port, the same ``--rdzv-id``); together they run
``fvstep verify-resume`` on one sharded model, crashing and resuming from a checkpoint
directory that both see (what a shared filesystem gives several machines), and the
resumed run must equal the uninterrupted one bit for bit. docs/multinode.md describes
the real thing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TIMEOUT_S = 300
"""Per agent: generous, for a loaded machine (the run itself takes seconds)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(node_rank: int, port: int, run_id: str, workdir: Path) -> subprocess.Popen:
    """One node's ``torchrun``: one rank, the c10d rendezvous at ``localhost:port``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "0",
        "-m",
        "fvstep",
        "verify-resume",
        "examples.resume_ok:factory",
        "--steps",
        "4",
        "--every",
        "1",
        "--interrupt",
        "1",
        "3",
        "--workdir",
        str(workdir),
    ]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.multirank
def test_two_torchrun_agents_on_a_c10d_rendezvous_resume_bitwise(tmp_path):
    workdir = tmp_path / "shared"  # one directory every node sees
    workdir.mkdir()
    port, run_id = _free_port(), f"fvstep-test-{uuid.uuid4().hex[:8]}"
    agents = [_agent(node, port, run_id, workdir) for node in (0, 1)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=TIMEOUT_S))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, f"stdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
    # Rank 0 runs on the agent that the rendezvous made node 0; it prints the verdict.
    verdicts = [out for out, _ in outputs if "resume is" in out]
    assert len(verdicts) == 1, outputs
    assert "resume is exact: examples.resume_ok:factory" in verdicts[0]
    assert "crashes before [1, 3]" in verdicts[0] and "2 rank(s)" in verdicts[0]
    # The checkpoints went where both nodes could see them, and were resumed from.
    assert (workdir / "checkpoints").is_dir()
