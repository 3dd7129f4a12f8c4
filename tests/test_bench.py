"""benchmarks/: the realshape sides it compares (tiny preset, CPU), and every benchmark module runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import realshape
from benchmarks.presets import PRESETS, build_model

pytest.importorskip("peft")

TARGETS = ["to_q", "to_k"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: ``benchmarks`` is not installed, and runs from there."""

HELPERS = (
    "__init__",
    "analytic",
    "common",
    "kernel_profile",
    "presets",
    "profiling",
    "reference",
    "roles",
)
"""The modules of ``benchmarks/`` that the benchmarks share, not benchmarks themselves."""

BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in HELPERS)


def adapter_size(rank: int) -> int:
    """LoRA parameters of one adapter on TARGETS, counted from the model's own layers."""
    model = build_model(PRESETS["tiny-wan"], device=torch.device("cpu"), seed=0)
    return sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in TARGETS
    )


def test_the_lora_side_trains_only_two_adapters_and_counts_base_calls_once(tmp_path, capsys):
    out = tmp_path / "realshape.json"
    argv = ["--preset", "tiny-wan", "--device", "cpu", "--steps", "2", "--warmup", "0"]
    argv += ["--sides", "prepared", "lora", "--lora-rank", "4", "--lora-targets", *TARGETS]
    assert realshape.main([*argv, "--json", str(out)]) == 0
    results = {r["side"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"prepared", "lora"}
    assert all("error" not in r for r in results.values()), results
    full = build_model(PRESETS["tiny-wan"], device=torch.device("cpu"), seed=0)
    assert results["prepared"]["trained_params"] == 2 * sum(p.numel() for p in full.parameters())
    assert results["lora"]["trained_params"] == 2 * adapter_size(4)
    # DMD2 alternates critic-only and student+critic steps. A LoRA role's call is counted
    # once (not again for the base it runs) and, under grad, as 2 forwards, not 3 (the
    # base's weights get no gradient): the sides differ by exactly one forward per call
    # that trains, the critic's (critic step), the student's and the critic's (both).
    prepared, lora = results["prepared"]["steps"], results["lora"]["steps"]
    assert set(prepared) == set(lora) == {"critic", "critic+student"}
    differences = {k: prepared[k]["model_forwards"] - lora[k]["model_forwards"] for k in lora}
    assert differences == {"critic": 1, "critic+student": 2}
    assert "lora" in capsys.readouterr().out


def test_the_lora_side_is_refused_for_fine_tuning(capsys):
    argv = ["--preset", "tiny-wan", "--device", "cpu", "--method", "finetune", "--sides", "lora"]
    assert realshape.main(argv) == 2
    assert "--method dmd2" in capsys.readouterr().err


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_runs_as_a_module(name):
    # `python -m fvstep.bench.<name>` once did nothing at all for three of them.
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_checkpointing_every_second_block_is_what_the_prepared_side_gets(tmp_path):
    out = tmp_path / "realshape.json"
    argv = ["--preset", "tiny-wan", "--device", "cpu", "--steps", "1", "--warmup", "0"]
    argv += ["--method", "finetune", "--sides", "prepared", "--checkpoint-every", "2"]
    assert realshape.main([*argv, "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    blocks = PRESETS["tiny-wan"].config["num_layers"]
    assert result["preparation"]["checkpoint_every"] == 2
    assert result["preparation"]["checkpointed_blocks"] == (blocks + 1) // 2
    assert realshape.main([*argv[:-2], "--checkpoint-every", "0"]) == 2


def test_the_floor_charges_each_call_what_its_kernels_cost():
    from benchmarks.floor import CallCounter, Calls, KernelTimes, floor_seconds

    k = KernelTimes(
        attention_forward=1.0, attention_forward_backward=10.0, linear_forward=100.0,
        linear_input_grad=1000.0, linear_weight_grad=10000.0, attention_backend="x",
        attention_tflops=0.0, linear_tflops=0.0,
    )  # fmt: skip
    # no grad: a forward; frozen: attention both ways, the forward GEMM and dX; trained: + dW
    assert floor_seconds(Calls(no_grad=2), k) == 2 * 101
    assert floor_seconds(Calls(frozen=1), k) == 1110
    assert floor_seconds(Calls(trained=0.5), k) == 0.5 * 11110
    assert Calls(no_grad=1, frozen=1, trained=1).forwards == 6
    trained = build_model(PRESETS["tiny-wan"], device=torch.device("cpu"), seed=0)
    frozen = build_model(PRESETS["tiny-wan"], device=torch.device("cpu"), seed=1)
    frozen.requires_grad_(False)
    counter = CallCounter({"a": trained, "b": frozen}, frames=PRESETS["tiny-wan"].latent_shape[1])
    from benchmarks.presets import make_batch
    from fvstep.methods.models import predict

    batch = make_batch(PRESETS["tiny-wan"], 2, device=torch.device("cpu"), seed=0)
    x, t = batch["latents"], torch.full((2,), 0.5)
    with torch.no_grad():
        predict(trained, x, t, batch["text"])
    predict(trained, x, t, batch["text"])
    predict(frozen, x[:1, :, :1].requires_grad_(), t[:1], batch["text"][:1])  # half the frames
    assert counter.take() == Calls(no_grad=2, frozen=0.5, trained=2)
    assert counter.take() == Calls()
    counter.close()


def test_the_streaming_method_runs_and_reports_the_floor_it_reaches(tmp_path):
    out = tmp_path / "realshape.json"
    argv = ["--preset", "tiny-wan", "--device", "cpu", "--steps", "2", "--warmup", "0"]
    argv += ["--method", "streaming", "--sides", "prepared", "--window-frames", "2"]
    assert realshape.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["info"]["kernels"]["attention_forward"] > 0
    (result,) = report["results"]
    assert set(result["steps"]) == {"critic", "critic+student"}, result
    for row in result["steps"].values():
        assert row["floor_s"] > 0 and row["of_floor"] == row["floor_s"] / row["seconds"]["median"]
    assert realshape.main([*argv, "--memory-budget", "2"]) == 2
