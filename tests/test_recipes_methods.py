"""The method recipes of ``fvstep train`` (``self_forcing``, ``streaming``,
``diffusion_nft``): each runs from the command line, resumes bitwise, plans its roles and
refuses a misconfiguration before it trains. One-layer tiny Wans on synthetic latents, on
the CPU."""

from __future__ import annotations

import json

import pytest
import torch

import fvstep as fs
from fvstep import checkpoint as ckpt
from fvstep.cli.train import run_train_command
from fvstep.recipes import get_recipe
from fvstep.recipes.config import parse_options
from fvstep.recipes.running import prepare_run, train

QUIET = ["--run.progress", "false", "--model.tiny.num_layers", "1", "--data.synthetic_size", "8"]
FEW_STEPS = ["--denoising_steps", "[1.0, 0.5]"]  # the causal recipes' schedule, shortened
SMALL = {  # each recipe at a small shape: 2 chunks, or a stream crossing a new start
    "self_forcing": [*FEW_STEPS, "--chunk_frames", "1", "--data.latent_shape", "[4, 2, 4, 4]"],
    "streaming": [
        *FEW_STEPS,
        *("--chunk_frames", "1", "--data.latent_shape", "[4, 1, 4, 4]"),
        *("--window_frames", "2", "--sink_frames", "1", "--steps_per_stream", "2"),
        *("--generator_update_interval", "2"),
    ],
    "diffusion_nft": ["--group_size", "2", "--rollout_steps", "2", "--kl_weight", "0.1"],
}
METHOD_RECIPES = tuple(SMALL)


def options(recipe: str, tmp_path, *argv: str, out: str = "run"):
    words = [*QUIET, *SMALL[recipe], "--run.out", str(tmp_path / out), *argv]
    return parse_options(get_recipe(recipe), words)


def quiet(line: str) -> None:
    pass


@pytest.mark.parametrize("recipe", METHOD_RECIPES)
def test_a_method_recipe_stopped_at_step_1_and_resumed_ends_bitwise_as_an_uninterrupted_run(
    recipe, tmp_path, capsys
):
    argv = [*SMALL[recipe], "--run.microbatches", "2", "--run.every", "1", "--run.log_every", "1"]
    whole = [recipe, *QUIET, *argv, "--run.out", str(tmp_path / "whole"), "--run.num_steps", "3"]
    assert run_train_command(whole) == 0  # fvstep train RECIPE ...
    assert f"done at step 3; run folder {tmp_path / 'whole'}" in capsys.readouterr().out
    train(get_recipe(recipe), options(recipe, tmp_path, *argv, "--run.num_steps", "1"), log=quiet)
    assert ckpt.latest(tmp_path / "run").name == "step_000000001"
    resumed = train(
        get_recipe(recipe), options(recipe, tmp_path, *argv, "--run.num_steps", "3"), log=quiet
    )
    like = prepare_run(get_recipe(recipe), options(recipe, tmp_path, *argv, out="x"), write=False)
    like.close()
    uninterrupted = ckpt.load(ckpt.latest(tmp_path / "whole"), like=like.state)
    assert int(resumed.step) == 3
    fs.tree.assert_trees_equal(resumed, uninterrupted, check_static=False)
    rows = [(tmp_path / f / "metrics.jsonl").read_text().splitlines() for f in ("run", "whole")]
    assert [json.loads(r)["step"] for r in rows[0]] == [0, 1, 2]
    assert rows[0] == rows[1]  # the same metrics, step for step


@pytest.mark.parametrize(
    ("recipe", "plan"),
    [
        (
            "self_forcing",
            [
                "step 0: self_forcing_fused updates student, critic (1 micro-batch, clip 1.0)",
                "step 1: self_forcing_critic updates critic (1 micro-batch, clip 1.0)",
            ],
        ),
        ("streaming", ["step 0: stream updates student, critic (1 micro-batch, clip 1.0)"]),
        ("diffusion_nft", ["step 0: diffusion_nft updates student (1 micro-batch, clip 1.0)"]),
    ],
)
def test_a_dry_run_prints_the_plan_naming_the_roles_each_step_trains_and_writes_nothing(
    recipe, plan, tmp_path, capsys
):
    argv = [recipe, *QUIET, *SMALL[recipe], "--run.out", str(tmp_path / "run"), "--dry-run"]
    assert run_train_command(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"recipe: {recipe}" in out
    first = out.index("# the first steps, from step 0, on 1 rank(s):")
    assert out[first + 1 : first + 1 + len(plan)] == plan
    assert not (tmp_path / "run").exists()


def test_the_roles_of_the_method_recipes_follow_their_methods(tmp_path):
    from fvstep.methods.causal_wan import chunk_frames_of, is_causal

    for recipe in ("self_forcing", "streaming"):
        spec = get_recipe(recipe).build(options(recipe, tmp_path), fresh=True)
        roles = spec.state.roles
        assert spec.trained == ("student", "critic")
        assert chunk_frames_of(roles["student"].role.module) == 1
        assert not any(is_causal(roles[r].role.module) for r in ("teacher", "critic"))
        assert roles["teacher"].role.save_frozen is False and roles["teacher"].opt_state is None
        fs.tree.assert_trees_equal(roles["student"].params, roles["teacher"].params)
    stream = spec.state.extra["stream"]
    assert stream.cache.capacity_frames == 3 and stream.cache.sink_frames == 1
    assert stream.frames.shape == (2, 4, 2, 4, 4) and int(stream.num_frames) == 0


def test_diffusion_nfts_old_policy_and_reference_start_as_the_initialised_student(tmp_path):
    finetune = ["--run.out", str(tmp_path / "ft"), "--run.num_steps", "1"]
    source = train(
        get_recipe("finetune"),
        parse_options(get_recipe("finetune"), [*QUIET, *finetune]),
        log=quiet,
    )
    opts = options(
        "diffusion_nft",
        tmp_path,
        *("--init_from.path", str(tmp_path / "ft"), "--prepare.frozen_dtype", "bfloat16"),
    )
    spec = prepare_run(get_recipe("diffusion_nft"), opts, log=quiet)
    spec.close()
    roles = spec.state.roles
    assert spec.trained == ("student",) and roles["old"].opt_state is None
    fs.tree.assert_trees_equal(roles["student"].params, source.roles["student"].params)
    fs.tree.assert_trees_equal(roles["old"].params, source.roles["student"].params)  # fp32
    for name, p in roles["reference"].params.items():  # frozen_dtype applies to it
        assert torch.equal(p, source.roles["student"].params[name].to(p.dtype)), name
    assert {p.dtype for p in roles["reference"].params.values()} >= {torch.bfloat16}


def test_the_streams_cache_is_kept_in_the_students_compute_dtype(tmp_path):
    from fvstep import parallel as fsp

    spec = get_recipe("streaming").build(options("streaming", tmp_path), fresh=True)
    assert spec.state.extra["stream"].cache.keys.dtype == torch.float32  # fp32 on the CPU
    bf16 = options("streaming", tmp_path, "--prepare.precision", "bf16")  # autocast, 1 process
    spec = get_recipe("streaming").build(bf16, fresh=True)
    assert fsp.preparation(spec.state.roles["student"].role.module).param_dtype == torch.bfloat16
    assert spec.state.extra["stream"].cache.keys.dtype == torch.bfloat16
    assert spec.state.extra["stream"].frames.dtype == torch.float32  # the latents' own


@pytest.mark.parametrize(
    ("recipe", "argv", "match"),
    [
        (
            "self_forcing",
            ["--chunk_frames", "3"],  # latents of 2 frames
            "has latents of 2 frames, not a multiple of chunk_frames=3",
        ),
        ("streaming", ["--window_frames", "0"], "window_frames must be an int >= 1"),
        (
            "streaming",
            ["--data.latent_shape", "[4, 3, 4, 4]"],  # a step's frames beyond the window
            "window_frames=2 must hold a step's 3 frames",
        ),
        ("diffusion_nft", ["--group_size", "1"], "group_size must be an int >= 2"),
        ("diffusion_nft", ["--reward", "colorfulness"], "reward 'colorfulness' .* needs a VAE"),
    ],
)
def test_a_misconfigured_method_recipe_is_refused_before_it_trains(recipe, argv, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        train(get_recipe(recipe), options(recipe, tmp_path, *argv), log=quiet)
    assert ckpt.latest(tmp_path / "run") is None


def test_diffusion_nft_takes_its_reward_by_name(tmp_path):
    import diffusers

    from fvstep.methods.models import tiny_wan

    pipeline = tmp_path / "pipe"  # a transformer and a tiny VAE are all the recipe reads
    tiny_wan(seed=0, num_layers=1).save_pretrained(pipeline / "transformer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        ).save_pretrained(pipeline / "vae")  # fmt: skip
    (pipeline / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    rewards = {}
    for reward in ("latent_mse", "colorfulness"):
        opts = options(
            "diffusion_nft",
            tmp_path,
            *("--reward", reward, "--model.path", str(pipeline), "--run.num_steps", "1"),
            out=reward,
        )
        train(get_recipe("diffusion_nft"), opts, log=quiet)
        row = json.loads((tmp_path / reward / "metrics.jsonl").read_text().splitlines()[0])
        rewards[reward] = row["diffusion_nft/reward_mean"]
    assert rewards["latent_mse"] < 0 < rewards["colorfulness"]  # -MSE; a colourfulness


def test_a_dataset_streams_from_its_first_batch_and_its_frames_are_checked_against_the_chunk(
    tmp_path,
):
    from fvstep.executor.latents import write_dataset

    gen = fs.random.generator(fs.random.key(3))
    rows = [
        {
            "latents": torch.randn(4, 1, 4, 4, generator=gen),
            "text": torch.randn(3, 16, generator=gen),
        }
        for _ in range(8)
    ]
    write_dataset(tmp_path / "latents", [rows[:4], rows[4:]])
    data = ["--data.path", str(tmp_path / "latents"), "--run.num_steps", "1"]
    state = train(get_recipe("streaming"), options("streaming", tmp_path, *data), log=quiet)
    assert int(state.extra["stream"].num_frames) == 1
    with pytest.raises(ValueError, match="latents of 1 frames, not a multiple of chunk_frames=2"):
        train(
            get_recipe("self_forcing"),
            options("self_forcing", tmp_path, *data, "--chunk_frames", "2", out="sf"),
            log=quiet,
        )


@pytest.mark.multirank
def test_a_two_rank_streaming_run_exports_its_student_from_one_process(tmp_path):
    # Its checkpoints hold each rank's stream (a cache per rank); `fvstep export` refused
    # them ("per-rank values ... cannot be loaded on 1") before it started them afresh.
    from safetensors.torch import load_file

    from fvstep.cli import main

    out, target = tmp_path / "run", tmp_path / "student"
    train_argv = [*QUIET, *SMALL["streaming"], "--run.out", str(out), "--run.every", "2"]
    assert main(["train", "streaming", *train_argv, "--run.num_steps", "2", "--nproc", "2"]) == 0
    manifest = ckpt.read_manifest(ckpt.latest(out))
    assert any(p.startswith("extra.stream.") for p in manifest.per_rank)
    export_argv = ["--role", "student", "--format", "safetensors", "--out", str(target)]
    assert main(["export", str(out), *export_argv]) == 0
    like = prepare_run(
        get_recipe("streaming"), options("streaming", tmp_path, out="x"), write=False
    )
    like.close()
    state = ckpt.load(ckpt.latest(out), like=like.state, reset="extra.stream")
    written = load_file(target / "model.safetensors")
    expected = ckpt.gather_weights(state, "student")
    assert expected is not None and written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
