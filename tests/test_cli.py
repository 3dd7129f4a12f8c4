"""The command line: the demo's verdict, verify-resume on a pure and an impure example,
and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fvstep.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "fvstep", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def test_demo_on_two_ranks_resumes_bitwise_and_writes_metrics_and_plot(tmp_path):
    out = tmp_path / "demo"
    result = run_cli("demo", "--steps", "8", "--every", "2", "--nproc", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESUMED RUN == UNINTERRUPTED RUN, bitwise" in result.stdout
    assert (out / "losses.png").stat().st_size > 10_000
    rows = [
        json.loads(line)
        for line in (out / "interrupted" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == list(range(8))


def test_verify_resume_passes_on_a_pure_example(capsys):
    assert main(["verify-resume", "examples.resume_ok:factory", "--steps", "4"]) == 0
    assert "resume is exact" in capsys.readouterr().out


def test_verify_resume_fails_with_a_readable_report_on_an_impure_example(capsys):
    assert main(["verify-resume", "examples.impure_global_rng:factory", "--steps", "4"]) == 1
    out = capsys.readouterr().out
    assert "resume is NOT exact" in out
    assert "trees differ at 'roles.student.params." in out and "max abs difference" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--out", "/proc/fvstep-unwritable"], "cannot write to the output directory"),
        (["demo", "--steps", "0"], "--steps must be >= 1"),
        (["verify-resume", "no_such_module:factory"], "cannot import 'no_such_module'"),
        (["verify-resume", "examples.resume_ok"], "must be MODULE:FACTORY"),
        (["verify-resume", "examples.resume_ok:nothing"], "has no callable 'nothing'"),
        (
            ["verify-resume", "tests.test_cli:wrong_shape_factory"],
            "must return (state, step_fn, data)",
        ),
        (["verify-resume", "examples.resume_ok:factory", "--interrupt", "9"], "must lie in [0, 6)"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(capsys, argv, message):
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def wrong_shape_factory():
    return "not a triple"


def test_debug_shows_the_traceback():
    result = run_cli("--debug", "verify-resume", "no_such_module:factory")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_verify_resume_runs_under_torchrun_on_two_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "fvstep",
            "verify-resume",
            "examples.resume_ok:factory",
            "--steps",
            "4",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resume is exact" in result.stdout and "2 rank(s)" in result.stdout
