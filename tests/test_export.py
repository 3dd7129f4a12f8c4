"""Consolidated export of one role: safetensors round trips, diffusers folders, EMA, dtype
casts, refusals and atomicity, on one process and on 2 FSDP2-sharded CPU ranks (gloo)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fvstep as fs
from fvstep.checkpoint.exporting import export, gather_weights
from fvstep.core import tree
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import predict, synthetic_batch, tiny_wan

diffusers = pytest.importorskip("diffusers")
WanTransformer3DModel = diffusers.WanTransformer3DModel
WEIGHTS = diffusers.utils.SAFETENSORS_WEIGHTS_NAME


def make_state(module: nn.Module | None = None, *, ema: bool = True) -> fs.TrainState:
    return fs.TrainState.create(
        {
            "student": fs.Role(
                tiny_wan(seed=0) if module is None else module,
                optimizer=fs.optim.adamw(lr=1e-3),
                ema=fs.EMA(0.9) if ema else None,
            )
        },
        key=fs.random.key(0),
    )


def trained_state(num_steps: int = 2) -> fs.TrainState:
    """Two steps, so that the parameters differ from the init and the EMA from both."""
    state = make_state()
    step = fs.compile(fs.update("student", flow_matching_loss()))
    for i in range(num_steps):
        state, _ = step(state, synthetic_batch(fs.random.fold_in(fs.random.key(1), i)))
    return state


def state_dict_of(state: fs.TrainState, role: str = "student") -> dict[str, torch.Tensor]:
    return dict(state.module(role).state_dict())


def load_diffusers(path: Path, **kwargs) -> nn.Module:
    """``WanTransformer3DModel.from_pretrained(path)``.

    diffusers 0.42 cannot load a class with ``_keep_in_fp32_modules`` (Wan has some)
    without accelerate: it forces ``low_cpu_mem_usage=False`` and then refuses it. When
    accelerate is missing, load with the fp32 list cleared (it only changes which
    tensors a ``torch_dtype`` cast skips; these loads are fp32).
    """
    try:
        import accelerate  # noqa: F401

        patch: contextlib.AbstractContextManager = contextlib.nullcontext()
    except ImportError:
        patch = pytest.MonkeyPatch.context()
    with patch as mp:
        if mp is not None:
            mp.setattr(WanTransformer3DModel, "_keep_in_fp32_modules", None)
        return WanTransformer3DModel.from_pretrained(path, **kwargs)


def tmp_leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.rglob(".*")]


# --- format="safetensors" -----------------------------------------------------------------


@pytest.mark.parametrize("target", ["dir", "file"])
def test_export_role_round_trip_is_bitwise_the_state_dict(tmp_path, target):
    state = trained_state()
    path = tmp_path / "out" if target == "dir" else tmp_path / "student.safetensors"
    written = export(state, "student", path)
    expected = tmp_path / "out" / "model.safetensors" if target == "dir" else path
    assert written == expected
    tree.assert_trees_equal(load_file(written), state_dict_of(state))
    assert tmp_leftovers(tmp_path) == []


def test_export_role_of_a_plain_module_keeps_integer_buffers_and_casts_floats(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    state = make_state(net, ema=False)
    written = export(state, "student", tmp_path, dtype=torch.bfloat16)
    assert written is not None
    loaded = load_file(written)
    expected = {
        n: t.to(torch.bfloat16) if t.is_floating_point() else t
        for n, t in state_dict_of(state).items()
    }
    assert loaded["1.num_batches_tracked"].dtype == torch.int64
    tree.assert_trees_equal(loaded, expected)


def test_export_role_ema_exports_the_average_for_trainable_params_and_live_values_else(
    tmp_path,
):
    module = tiny_wan(seed=0)
    module.patch_embedding.bias.requires_grad_(False)  # a frozen param of a trained role
    state = make_state(module)
    step = fs.compile(fs.update("student", flow_matching_loss()))
    for i in range(2):
        state, _ = step(state, synthetic_batch(fs.random.fold_in(fs.random.key(1), i)))
    rs = state.roles["student"]
    assert rs.ema is not None and "patch_embedding.bias" not in rs.ema.params
    written = export(state, "student", tmp_path, weights="ema")
    assert written is not None
    loaded = load_file(written)
    expected = {**state_dict_of(state), **rs.ema.params}
    tree.assert_trees_equal(loaded, expected)
    # Two updates in, the average differs from the live weights.
    assert not torch.equal(loaded["proj_out.weight"], rs.params["proj_out.weight"])


def test_gather_weights_never_shares_memory_with_the_state():
    state = make_state()
    weights = gather_weights(state, "student")
    assert weights is not None
    live = state.roles["student"].params["proj_out.weight"]
    weights["proj_out.weight"].add_(1.0)
    assert not torch.equal(weights["proj_out.weight"], live)


# --- format="diffusers" -------------------------------------------------------------------


def test_export_diffusers_loads_bitwise_and_predicts_the_same(tmp_path):
    state = trained_state()
    path = tmp_path / "student"
    assert export(state, "student", path, format="diffusers") == path
    assert sorted(p.name for p in path.iterdir()) == ["config.json", WEIGHTS]
    module = state.module("student")
    assert json.loads((path / "config.json").read_text()) == json.loads(module.to_json_string())
    loaded = load_diffusers(path)
    tree.assert_trees_equal(dict(loaded.state_dict()), state_dict_of(state))
    batch = synthetic_batch(fs.random.key(3), batch_size=2)
    t = torch.full((2,), 500.0)
    module.eval()
    loaded.eval()
    with torch.no_grad():
        ours = predict(module, batch["latents"], t, batch["text"])
        theirs = predict(loaded, batch["latents"], t, batch["text"])
    assert torch.equal(ours, theirs)
    assert tmp_leftovers(tmp_path) == []


def test_export_diffusers_ema_loads_the_average(tmp_path):
    state = trained_state()
    export(state, "student", tmp_path / "ema", weights="ema", format="diffusers")
    loaded = load_diffusers(tmp_path / "ema")
    expected = {**state_dict_of(state), **state.roles["student"].ema.params}
    tree.assert_trees_equal(dict(loaded.state_dict()), expected)


def test_export_diffusers_dtype_cast_keeps_the_classes_fp32_modules_in_fp32(tmp_path):
    state = make_state()
    export(state, "student", tmp_path / "bf16", dtype=torch.bfloat16, format="diffusers")
    loaded = load_file(tmp_path / "bf16" / WEIGHTS)
    keep = WanTransformer3DModel._keep_in_fp32_modules
    for name, value in state_dict_of(state).items():
        dtype = torch.float32 if any(m in name.split(".") for m in keep) else torch.bfloat16
        assert torch.equal(loaded[name], value.to(dtype)), name
        assert loaded[name].dtype == dtype, name
    assert any(t.dtype == torch.float32 for t in loaded.values())
    assert any(t.dtype == torch.bfloat16 for t in loaded.values())


# --- refusals and atomicity ---------------------------------------------------------------


def test_errors_name_the_problem(tmp_path):
    state = make_state(ema=False)
    with pytest.raises(ValueError, match="no role 'critic'"):
        export(state, "critic", tmp_path)
    with pytest.raises(ValueError, match="no EMA"):
        export(state, "student", tmp_path, weights="ema")
    with pytest.raises(ValueError, match="no EMA"):
        export(state, "student", tmp_path / "d", weights="ema", format="diffusers")
    with pytest.raises(ValueError, match="weights must be"):
        export(state, "student", tmp_path, weights="average")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating-point"):
        export(state, "student", tmp_path, dtype=torch.int32)
    (tmp_path / "x.safetensors").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        export(state, "student", tmp_path / "x.safetensors")
    plain = make_state(nn.Linear(2, 2), ema=False)
    with pytest.raises(ValueError, match="diffusers ModelMixin.*format=.safetensors."):
        export(plain, "student", tmp_path / "d", format="diffusers")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_existing_exports_are_kept_unless_overwrite(tmp_path):
    old, new = make_state(), trained_state()
    file = export(old, "student", tmp_path / "f.safetensors")
    with pytest.raises(ValueError, match="overwrite=True"):
        export(new, "student", tmp_path / "f.safetensors")
    tree.assert_trees_equal(load_file(file), state_dict_of(old))
    export(new, "student", tmp_path / "f.safetensors", overwrite=True)
    tree.assert_trees_equal(load_file(file), state_dict_of(new))

    folder = tmp_path / "d"
    folder.mkdir()  # an empty folder is a fine target
    export(old, "student", folder, format="diffusers")
    with pytest.raises(ValueError, match="not empty.*overwrite=True"):
        export(new, "student", folder, format="diffusers")
    tree.assert_trees_equal(load_file(folder / WEIGHTS), state_dict_of(old))
    export(new, "student", folder, overwrite=True, format="diffusers")
    tree.assert_trees_equal(load_file(folder / WEIGHTS), state_dict_of(new))
    with pytest.raises(ValueError, match="exists and is not a directory"):
        export(new, "student", file, overwrite=True, format="diffusers")  # a file is never replaced
    tree.assert_trees_equal(load_file(file), state_dict_of(new))
    assert tmp_leftovers(tmp_path) == []


def test_a_failed_write_leaves_the_previous_export_intact(tmp_path, monkeypatch):
    import safetensors.torch

    old = make_state()
    file = export(old, "student", tmp_path / "f.safetensors")
    export(old, "student", tmp_path / "d", format="diffusers")

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    new = trained_state()
    with pytest.raises(OSError, match="disk full"):
        export(new, "student", tmp_path / "f.safetensors", overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        export(new, "student", tmp_path / "d", overwrite=True, format="diffusers")
    monkeypatch.undo()
    tree.assert_trees_equal(load_file(file), state_dict_of(old))
    tree.assert_trees_equal(load_file(tmp_path / "d" / WEIGHTS), state_dict_of(old))
    assert tmp_leftovers(tmp_path) == []


# --- 2 FSDP2-sharded ranks ----------------------------------------------------------------


def check_sharded_export(rank: int, world_size: int, directory: str):
    from fvstep import parallel as fsp

    mesh = fsp.make_mesh(device_type="cpu")
    module = fsp.shard_module(tiny_wan(seed=0), mesh=mesh)
    state = make_state(module)
    assert type(module).__name__ == "FSDPWanTransformer3DModel"
    assert all(hasattr(p, "full_tensor") for p in state.roles["student"].params.values())
    out = Path(directory)
    written = {
        "params": export(state, "student", out / "params"),
        "ema_bf16": export(
            state, "student", out / "ema.safetensors", weights="ema", dtype=torch.bfloat16
        ),
        "diffusers": export(state, "student", out / "diffusers", format="diffusers"),
    }
    try:  # refused on rank 0 (which checks the path), raised on every rank: no hang
        export(state, "student", out / "params")
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return {k: None if v is None else str(v) for k, v in written.items()}, refusal


@pytest.mark.multirank
def test_sharded_export_is_bitwise_the_unsharded_model_and_loads_in_diffusers(ranks, tmp_path):
    (paths, refusal_0), (others, refusal_1) = ranks.run(check_sharded_export, str(tmp_path))
    assert all(v is None for v in others.values()), others
    assert "overwrite=True" in refusal_0 and "rank 0" in refusal_1 and "overwrite" in refusal_1
    expected = dict(tiny_wan(seed=0).state_dict())
    tree.assert_trees_equal(load_file(paths["params"]), expected)
    tree.assert_trees_equal(
        load_file(paths["ema_bf16"]), {n: t.to(torch.bfloat16) for n, t in expected.items()}
    )
    config = json.loads((Path(paths["diffusers"]) / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel"
    loaded = load_diffusers(Path(paths["diffusers"]))
    tree.assert_trees_equal(dict(loaded.state_dict()), expected)
    assert tmp_leftovers(tmp_path) == []


# --- format="pipeline": a whole diffusers pipeline folder ---------------------------------------


def tiny_tokenizer():
    """A word-level tokenizer built here (no download): ``tokenizers`` + transformers'
    ``PreTrainedTokenizerFast``, which ``DiffusionPipeline.from_pretrained`` reloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["a", "cat", "dog", "runs", "on", "the", "grass"]
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_base_pipeline(path: Path) -> Path:
    """A complete tiny ``WanPipeline`` folder (VAE, UMT5 text encoder, tokenizer, UniPC
    scheduler, transformer), built from configs on the CPU: a stand-in for a base model."""
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.test_sampling import tiny_vae

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=16,
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=1,
                num_heads=2,
                relative_attention_num_buckets=8,
            )
        )
    pipe = diffusers.WanPipeline(
        tokenizer=tiny_tokenizer(),
        text_encoder=text_encoder,
        vae=tiny_vae(),
        scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction"),
        transformer=tiny_wan(seed=5),
    )
    pipe.save_pretrained(path)
    return path


def test_export_pipeline_loads_and_reproduces_the_in_training_sampler(tmp_path):
    from fvstep.executor.sampling import EulerSampler, decode_latents, sample

    base = tiny_base_pipeline(tmp_path / "base")
    state = trained_state()
    sampler = EulerSampler(3, shift=3.0)
    out = export(
        state,
        "student",
        tmp_path / "pipe",
        base=base,
        weights="ema",
        scheduler=sampler.scheduler(),
        format="pipeline",
    )
    assert out == tmp_path / "pipe" and tmp_leftovers(tmp_path) == []
    pipe = diffusers.DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == "WanPipeline"
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    pipe.set_progress_bar_config(disable=True)
    # the transformer is the role's EMA; the other parts are the base's, unchanged
    ema = state.roles["student"].ema.params
    loaded = dict(pipe.transformer.state_dict())
    tree.assert_trees_equal({n: loaded[n] for n in ema}, ema)
    base_vae = diffusers.AutoencoderKLWan.from_pretrained(base / "vae")
    tree.assert_trees_equal(dict(pipe.vae.state_dict()), dict(base_vae.state_dict()))

    text = synthetic_batch(fs.random.key(3), batch_size=1, text_len=8)["text"]
    noise = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    kwargs = {
        "prompt_embeds": text,
        "latents": noise,
        "num_inference_steps": 3,
        "guidance_scale": 1.0,
        "height": 32,
        "width": 32,
        "num_frames": 5,
    }
    with torch.no_grad():
        latents = pipe(**kwargs, output_type="latent").frames
        frames = pipe(**kwargs, output_type="np").frames
    from fvstep.executor.validation import role_module

    with role_module(state, "student", weights="ema") as module:
        ours = sample(module, noise, text, sampler=sampler)
    tree.assert_trees_equal(latents, ours)  # bitwise: the same steps in the same order
    ours_pixels = decode_latents(pipe.vae, ours)
    tree.assert_trees_equal(torch.from_numpy(frames), ours_pixels)
    # the whole text path works too: tokenizer and text encoder came from the base
    with torch.no_grad():
        video = pipe(
            prompt="a cat runs",
            **{k: v for k, v in kwargs.items() if k != "prompt_embeds"},
            max_sequence_length=8,
            output_type="np",
        ).frames
    assert video.shape == (1, 5, 32, 32, 3)


def test_export_pipeline_links_refuses_and_keeps_the_base_scheduler(tmp_path):

    base = tiny_base_pipeline(tmp_path / "base")
    state = trained_state(1)
    out = export(state, "student", tmp_path / "linked", base=base, link=True, format="pipeline")
    assert (out / "vae").is_symlink() and not (out / "transformer").is_symlink()
    index = json.loads((out / "model_index.json").read_text())
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    pipe = diffusers.DiffusionPipeline.from_pretrained(out)
    tree.assert_trees_equal(dict(pipe.transformer.state_dict()), state_dict_of(state))
    with pytest.raises(ValueError, match="overwrite=True"):
        export(state, "student", out, base=base, format="pipeline")
    export(state, "student", out, base=base, overwrite=True, format="pipeline")
    with pytest.raises(ValueError, match="model_index.json"):
        export(
            state, "student", tmp_path / "x", base=tmp_path / "linked" / "vae", format="pipeline"
        )
    with pytest.raises(ValueError, match="nest"):
        export(state, "student", base / "inside", base=base, format="pipeline")
    with pytest.raises(ValueError, match="no component"):
        export(state, "student", tmp_path / "y", base=base, component="unet", format="pipeline")
    assert tmp_leftovers(tmp_path) == []


def check_sharded_pipeline_export(rank: int, world_size: int, directory: str, base: str):
    from fvstep import parallel as fsp

    mesh = fsp.make_mesh(device_type="cpu")
    state = make_state(fsp.shard_module(tiny_wan(seed=0), mesh=mesh))
    out = export(
        state, "student", Path(directory) / "pipe", base=base, weights="ema", format="pipeline"
    )
    return None if out is None else str(out)


@pytest.mark.heavy
@pytest.mark.multirank
def test_sharded_pipeline_export_writes_the_unsharded_weights_and_loads(ranks, tmp_path):
    base = tiny_base_pipeline(tmp_path / "base")
    out, other = ranks.run(check_sharded_pipeline_export, str(tmp_path), str(base))
    assert other is None
    pipe = diffusers.DiffusionPipeline.from_pretrained(out)
    tree.assert_trees_equal(
        dict(pipe.transformer.state_dict()), dict(tiny_wan(seed=0).state_dict())
    )
