"""The command line: the demo's verdict and a summary of what it ran, verify-resume on a
pure and an impure example, one-line errors for bad input, Ctrl-C, help and version; each
command's parser made from its function (every option in ``--help`` with its description,
a misspelt option answered with the closest one, argparse's spellings kept)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fvstep.cli import COMMANDS, main
from fvstep.cli.common import command_parser, parse

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
    train_rows = [r for r in rows if not any(k.startswith("val/") for k in r)]
    assert [r["step"] for r in train_rows] == list(range(8))
    assert any("val/loss" in r for r in rows)
    # The summary states what ran: a crash before step 5, half an interval after the
    # checkpoint at step 4, which the restart loaded and which is kept.
    summary = summary_rows(result.stdout)
    assert summary["interruption"].startswith(
        "crashed before step 5 (checkpoints then: steps 2, 4); restarted from the newest, "
        "step 4, and recomputed step 4"
    )
    assert summary["resumed from"] == str(out / "interrupted" / "step_000000004")
    assert (out / "interrupted" / "step_000000004").is_dir()
    assert summary["checkpoints"].endswith("interrupted/ steps 2, 4, 6, 8")
    assert summary["sync policy"].startswith("deferred. A policy changes when gradients")
    assert "reduce_scatter" in summary["collectives"]


def summary_rows(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.split("fvstep demo — ")[-1].splitlines()[1:]:
        name, _, text = line.strip().partition("  ")
        rows[name] = text.strip()
    return rows


def test_demo_on_one_rank_claims_no_sync_policy_and_keeps_what_it_resumed_from(tmp_path):
    out = tmp_path / "demo"
    result = run_cli("demo", "--steps", "7", "--nproc", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summary_rows(result.stdout)
    assert summary["sync policy"].startswith("none: one rank communicates no gradients")
    assert "deferred" not in summary["ranks"] + summary["steps"]
    assert summary["interruption"].startswith("crashed before step 6 (checkpoints then: step 4)")
    assert (out / "interrupted" / "step_000000004").is_dir()
    assert summary["verdict"].startswith("RESUMED RUN == UNINTERRUPTED RUN, bitwise")

    again = run_cli("demo", "--steps", "7", "--nproc", "1", "--out", str(out))
    assert again.returncode == 2
    assert "holds an earlier demo's output" in again.stderr and "--overwrite" in again.stderr
    assert (out / "interrupted" / "step_000000004").is_dir()  # untouched


DEMO_ARGS = ("--steps", "8", "--every", "2", "--nproc", "2")


def test_ctrl_c_on_the_demo_exits_130_with_one_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    demo = subprocess.Popen(
        [sys.executable, "-m", "fvstep", "demo", *DEMO_ARGS, "--out", str(tmp_path / "demo")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    assert demo.stdout is not None
    for line in demo.stdout:
        if line.startswith("[1/3]"):  # rank 0 is training
            os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C: the launcher and every rank
            break
    _, stderr = demo.communicate(timeout=300)
    assert demo.returncode == 130, stderr[-3000:]
    # The progress bar (stderr, "step/s") aside, one line.
    lines = [line for line in stderr.splitlines() if line.strip() and "step/s" not in line]
    assert lines == ["fvstep: interrupted"], stderr[-3000:]


def test_version_and_help_texts():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("fvstep 0.")
    demo_help = " ".join(run_cli("demo", "--help").stdout.split())  # unwrapped
    assert "changes communication, not results" in demo_help and "default: deferred)" in demo_help
    assert "--overwrite" in demo_help
    verify_help = " ".join(run_cli("verify-resume", "--help").stdout.split())
    assert "steps of each run (type: int, default: 6)" in verify_help
    assert "ranks to launch" in verify_help


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
        (["demo", "--steps", "0"], "--steps must be >= 7 with --every 4"),
        (["demo", "--steps", "-1"], "--steps must be >= 7 with --every 4"),
        (["demo", "--steps", "4", "--every", "100"], "--steps must be >= 151 with --every 100"),
        (["demo", "--every", "0"], "--every must be >= 1"),
        (["demo", "--nproc", "0"], "--nproc must be >= 1"),
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


LEAVES = {
    f"{name} {sub}".strip(): fn
    for name, command in COMMANDS.items()
    for sub, fn in (command.items() if isinstance(command, dict) else [("", command)])
}
"""Every command that runs (``demo``, ``data encode``, ...) and its function."""

POSITIONALS = {"verify-resume": ["m:f"], "verify-compile": ["m:f"], "export": ["c", "--out", "o"]}
POSITIONALS["data encode"] = ["clips", "out"]


def options_and_descriptions(fn) -> dict[str, str]:
    """A command's options (its function's parameters; of ``train`` and ``plan``, the
    keyword-only ones) and their descriptions (the docstring's ``Args``)."""
    import docstring_parser

    docs = {p.arg_name: p.description for p in docstring_parser.parse(fn.__doc__).params}
    params = inspect.signature(fn).parameters.values()
    if fn in (COMMANDS["train"], COMMANDS["plan"]):
        params = [p for p in params if p.kind == p.KEYWORD_ONLY]
    return {
        f"--{p.name.replace('_', '-')}" if p.kind == p.KEYWORD_ONLY else p.name: docs[p.name]
        for p in params
    }


@pytest.mark.parametrize("command", sorted(LEAVES))
def test_each_commands_help_lists_each_option_with_its_description(capsys, command):
    assert main([*command.split(), "--help"]) == 0
    out = capsys.readouterr().out
    options = options_and_descriptions(LEAVES[command])
    assert options
    for option, description in options.items():
        assert f"  {option}" in out, option
        assert "".join(description.split()) in "".join(out.split()), (option, description)


@pytest.mark.parametrize("command", sorted(LEAVES))
def test_a_misspelt_option_of_each_command_exits_2_naming_the_closest(capsys, command):
    options = [o for o in options_and_descriptions(LEAVES[command]) if o.startswith("--")]
    assert options
    for option in options:
        typo = option + option[-1]  # --nprocc
        assert main([*command.split(), *POSITIONALS.get(command, []), typo, "1"]) == 2
        err = capsys.readouterr().err
        assert f"unrecognized arguments: {typo} 1: did you mean {option}?" in err, err
        assert err.count("\n") == 1, err


def test_a_commands_options_keep_argparse_spellings_dashes_bare_flags_and_lists():
    verify = command_parser(COMMANDS["verify-resume"], "fvstep verify-resume")
    assert parse(verify, ["m:f", "--interrupt", "3", "6"]).interrupt == [3, 6]
    export = command_parser(COMMANDS["export"], "fvstep export")
    assert parse(export, ["c", "--out", "o", "--overwrite"]).overwrite is True
    assert parse(export, ["c", "--out", "o"]).overwrite is False
    encode = command_parser(COMMANDS["data"]["encode"], "fvstep data encode")
    parsed = parse(encode, ["clips", "out", "--num-frames", "9", "--world-size", "2"])
    assert (parsed.num_frames, parsed.world_size, parsed.model_dtype) == (9, 2, "float32")
