"""Sample videos at a cadence from ``fvstep train`` (``validation.sample_every``,
:mod:`fvstep.recipes.samples`): written where a user can watch them, bitwise the same in
a resumed run, never changing the training, each recipe's student sampled by the sampler
it is trained for, and refused before training where they cannot be made.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fvstep as fs
from fvstep.cli import main
from fvstep.cli.export import _load_run
from fvstep.executor.sampling import EulerSampler, FewStepSampler
from fvstep.methods.causal_rollout import shifted_steps
from fvstep.recipes import get_recipe
from fvstep.recipes.config import parse_options

# tiny-wan's VAE: 4x in time (1 + 4 (F - 1) frames), 8x in space; the synthetic latents
# are (4, 2, 4, 4)
NUM_FRAMES, SIZE = 5, 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from fvstep.recipes.tiny_pipeline import save_tiny_pipeline

    return save_tiny_pipeline(tmp_path_factory.mktemp("pipeline") / "tiny-wan")


def _train(tiny: Path, out: Path, *argv: str, recipe: str = "finetune") -> int:
    common = ["--model.path", str(tiny), "--run.out", str(out), "--run.progress", "false"]
    return main(["train", recipe, *common, "--validation.sample_steps", "2", *argv])


def _pixels(run: Path, step: int, i: int) -> np.ndarray:
    """The frames of a sample, side by side: its PNG strip (lossless)."""
    import imageio.v3 as iio

    return iio.imread(run / "media" / f"step_{step:09d}" / f"samples_sample_{i}.png")


def _decoded(path: Path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_samples_are_written_at_their_steps_as_mp4_of_the_decoded_frames(tiny, tmp_path):
    argv = ["--validation.sample_every", "2", "--run.num_steps", "4"]
    assert _train(tiny, tmp_path / "run", *argv) == 0
    media = tmp_path / "run" / "media"
    assert sorted(p.name for p in media.iterdir()) == [f"step_{s:09d}" for s in (0, 2, 4)]
    for step in (0, 2, 4):
        for i in range(2):  # validation.num_videos
            frames = _decoded(media / f"step_{step:09d}" / f"samples_sample_{i}.mp4")
            assert len(frames) == NUM_FRAMES
            assert all(f.shape == (SIZE, SIZE, 3) for f in frames)
            assert _pixels(tmp_path / "run", step, i).shape == (SIZE, SIZE * NUM_FRAMES, 3)
    # fixed noise: the videos change with the weights alone, and the weights changed
    assert not np.array_equal(_pixels(tmp_path / "run", 0, 0), _pixels(tmp_path / "run", 4, 0))


def test_samples_of_a_resumed_run_are_bitwise_an_uninterrupted_runs_and_leave_training_alone(
    tiny, tmp_path
):
    argv = ["--validation.sample_every", "2", "--run.every", "2"]
    assert _train(tiny, tmp_path / "whole", *argv, "--run.num_steps", "4") == 0
    assert _train(tiny, tmp_path / "stopped", *argv, "--run.num_steps", "2") == 0
    assert _train(tiny, tmp_path / "stopped", *argv, "--run.num_steps", "4") == 0  # resumes
    none = ["--validation.sample_every", "0", "--run.every", "2", "--run.num_steps", "4"]
    assert _train(tiny, tmp_path / "none", *none) == 0

    for step in (2, 4):
        for i in range(2):
            whole, stopped = (
                _pixels(tmp_path / "whole", step, i),
                _pixels(tmp_path / "stopped", step, i),
            )
            assert np.array_equal(whole, stopped), (step, i)
    whole, _ = _load_run(str(tmp_path / "whole"))
    resumed, _ = _load_run(str(tmp_path / "stopped"))
    unsampled, _ = _load_run(str(tmp_path / "none"))
    assert int(whole.step) == 4
    fs.tree.assert_trees_equal(resumed, whole, check_static=False)
    fs.tree.assert_trees_equal(unsampled, whole, check_static=False)
    assert not (tmp_path / "none" / "media").exists()


_STEPS = shifted_steps((1.0, 0.75, 0.5, 0.25), 5.0)


@pytest.mark.parametrize(
    "recipe, argv, sampler, weights",
    [
        ("finetune", [], EulerSampler(2, shift=3.0), "ema"),  # the pipeline scheduler's shift
        ("finetune", ["--optim.ema", "null"], EulerSampler(2, shift=3.0), "params"),
        ("diffusion_nft", [], EulerSampler(2, shift=3.0), "ema"),
        ("dmd2", [], FewStepSampler((1.0,)), "ema"),
        ("lora_dmd2", [], FewStepSampler((1.0,)), "ema"),
        ("self_forcing", [], FewStepSampler(_STEPS), "ema"),
        ("streaming", ["--validation.sample_weights", "params"], FewStepSampler(_STEPS), "params"),
    ],
)
def test_each_recipe_samples_its_student_with_the_sampler_it_trains_for(
    tiny, tmp_path, monkeypatch, recipe, argv, sampler, weights
):
    from fvstep.recipes import samples

    seen: list[dict] = []

    def spy(text, **kwargs):
        seen.append(kwargs)
        return lambda state, key: {}

    monkeypatch.setattr(samples, "sample_videos", spy)
    chosen = get_recipe(recipe)
    flags = ["--validation.sample_every", "3", "--validation.sample_steps", "2", *argv]
    where = ["--model.path", str(tiny), "--run.out", str(tmp_path / "run")]
    options = parse_options(chosen, [*where, *flags])
    spec = chosen.build(options, fresh=True)
    try:
        validation = spec.run_options["validation"]
        videos = [v for v in validation if v.prefix == samples.SAMPLES_PREFIX]
        assert len(videos) == 1 and videos[0].every == 3
        videos[0].fn(spec.state, fs.random.key(0))
    finally:
        spec.close()
    [call] = seen
    assert call["sampler"] == sampler and call["weights"] == weights and call["role"] == "student"
    assert tuple(call["latent_shape"]) == options.data.latent_shape


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no pipeline folder with a vae/"),  # the embedded tiny Wan: no VAE
        (["--model.path", "TINY", "--validation.num_videos", "3"], "validation.num_videos is 3"),
        (
            ["--model.path", "TINY", "--optim.ema", "null", "--validation.sample_weights", "ema"],
            "keeps no EMA",
        ),
    ],
)
def test_samples_that_cannot_be_made_are_refused_before_anything_is_written(
    tiny, tmp_path, capsys, argv, message
):
    argv = [str(tiny) if a == "TINY" else a for a in argv]
    out = tmp_path / "run"
    command = ["train", "finetune", "--run.out", str(out), "--validation.sample_every", "2"]
    assert main([*command, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()
