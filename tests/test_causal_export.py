"""A causal student stays causal when exported and when sampled.

- Export: a diffusers folder of a causal role records its chunk (``config.json``), and
  ``load_causal`` restores the causal model, bitwise the role's module; a plain
  ``from_pretrained`` of it is bidirectional, and fvstep refuses to compute with such a
  model where it can see it (sampling, export, ``chunk_frames_of``, the recipes' loaders).
- Sampling: ``fvstep.executor.sampling.sample`` of a causal Wan generates chunk by chunk with its
  KV cache: bitwise ``causal_rollout.rollout`` with every chunk exiting at the last step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fvstep as fs
from fvstep.checkpoint import export
from fvstep.checkpoint.exporting import CAUSAL_METADATA_KEY
from fvstep.core import random as fsrandom
from fvstep.executor.sampling import EulerSampler, FewStepSampler, sample
from fvstep.executor.validation import role_module
from fvstep.methods import self_forcing
from fvstep.methods.causal_rollout import rollout
from fvstep.methods.causal_wan import (
    CAUSAL_CONFIG_KEY,
    chunk_frames_of,
    is_causal,
    load_causal,
    make_causal,
    recorded_chunk_frames,
)
from fvstep.methods.models import predict, synthetic_batch, tiny_wan


@pytest.fixture(scope="module")
def trained_state():
    adamw = fs.optim.adamw(lr=1e-2)
    state = fs.TrainState.create(
        {
            "student": fs.Role(
                make_causal(tiny_wan(seed=0), chunk_frames=1),
                optimizer=adamw,
                ema=fs.EMA(decay=0.5, start_step=0),
            ),
            "teacher": fs.Role(tiny_wan(seed=0)),
            "critic": fs.Role(tiny_wan(seed=1), optimizer=adamw),
        },
        key=fs.random.key(0),
    )
    step = fs.compile(self_forcing(generator_update_interval=1, denoising_steps=(1.0, 0.5)))
    batch = synthetic_batch(fs.random.key(1), batch_size=2, frames=2)
    state, _ = step(state, batch)
    return state


def _probe():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 2, 4, 4, generator=g)
    text = torch.randn(2, 3, 16, generator=g)
    return x, torch.full((2,), 400.0), text


@pytest.mark.parametrize("weights", ["params", "ema"])
def test_an_exported_causal_role_loads_back_causal_and_bitwise(trained_state, tmp_path, weights):
    from diffusers import WanTransformer3DModel

    path = tmp_path / "student"
    export(trained_state, "student", path, weights=weights, format="diffusers")
    config = json.loads((path / "config.json").read_text())
    assert config[CAUSAL_CONFIG_KEY] == {"chunk_frames": 1}
    loaded = load_causal(path)
    assert chunk_frames_of(loaded) == 1
    x, t, text = _probe()
    with torch.no_grad():
        with role_module(trained_state, "student", weights=weights) as module:
            expected = predict(module, x, t, text)
        got = predict(loaded, x, t, text)
        plain = WanTransformer3DModel.from_pretrained(path)
        bidirectional = predict(plain, x, t, text)
    assert torch.equal(got, expected)
    # a plain diffusers load builds the bidirectional model of the same weights
    assert not is_causal(plain) and recorded_chunk_frames(plain) == 1
    assert (bidirectional - expected).abs().max() > 1e-2


def test_a_plain_safetensors_export_of_a_causal_role_records_its_chunk(trained_state, tmp_path):
    from safetensors import safe_open

    causal = export(trained_state, "student", tmp_path / "student")
    plain = export(trained_state, "critic", tmp_path / "critic")
    with safe_open(str(causal), "pt") as f:
        record = json.loads(f.metadata()[CAUSAL_METADATA_KEY])
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open's API)
    with safe_open(str(plain), "pt") as f:
        assert CAUSAL_METADATA_KEY not in f.metadata()
    assert record == {"chunk_frames": 1}
    # the checkpoint layer's copies of the methods' names (it may not import them)
    from fvstep.checkpoint.exporting import _CAUSAL_ROPE_ATTR
    from fvstep.methods._causal_attention import CAUSAL_ATTR

    assert (CAUSAL_METADATA_KEY, _CAUSAL_ROPE_ATTR) == (CAUSAL_CONFIG_KEY, CAUSAL_ATTR)
    # what the record is for: the file's weights into a module rebuilt with it compute
    # what the role did
    rebuilt = make_causal(tiny_wan(seed=5), chunk_frames=record["chunk_frames"])
    rebuilt.load_state_dict(weights)
    x, t, text = _probe()
    with torch.no_grad(), role_module(trained_state, "student") as module:
        assert torch.equal(predict(rebuilt, x, t, text), predict(module, x, t, text))


def test_a_lora_roles_safetensors_export_records_its_causal_bases_chunk(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors import safe_open

    from fvstep.methods.lora import add_adapters

    base = make_causal(tiny_wan(seed=0), chunk_frames=2)
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"])
    lora = add_adapters(base, {"student": config})
    adamw = fs.optim.adamw(lr=1e-3)
    roles = {"student": fs.Role(lora["student"], optimizer=adamw), "base": fs.Role(base)}
    state = fs.TrainState.create(roles, key=fs.random.key(0))
    for role in roles:
        with safe_open(str(export(state, role, tmp_path / role)), "pt") as f:
            assert json.loads(f.metadata()[CAUSAL_METADATA_KEY]) == {"chunk_frames": 2}, role


def test_a_merged_lora_export_over_a_causal_base_loads_back_causal_and_computes_the_role(
    tmp_path,
):
    """LoRA's ``format="merged"`` export writes the base's config: over a causal base it carries the
    record, ``load_causal`` rebuilds the causal model of the merged weights, and a plain
    ``from_pretrained`` of the folder is the bidirectional model fvstep refuses elsewhere."""
    peft = pytest.importorskip("peft")
    from diffusers import WanTransformer3DModel

    from fvstep.methods.lora import add_adapters

    base = make_causal(tiny_wan(seed=0), chunk_frames=1)
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"])
    lora = add_adapters(base, {"student": config})
    roles = {
        "student": fs.Role(lora["student"], optimizer=fs.optim.adamw(lr=1e-3)),
        "base": fs.Role(base),
    }
    state = fs.TrainState.create(roles, key=fs.random.key(0))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # an adapter that changes the output (peft starts B at zero)
        for name, p in state.roles["student"].params.items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    path = export(state, "student", tmp_path / "merged", format="merged")
    assert json.loads((path / "config.json").read_text())[CAUSAL_CONFIG_KEY] == {"chunk_frames": 1}
    loaded = load_causal(path)
    x, t, text = _probe()
    with torch.no_grad():
        with role_module(state, "student") as module:
            expected = predict(module, x, t, text)
        with role_module(state, "base") as module:
            without_adapter = predict(module, x, t, text)
        got = predict(loaded, x, t, text)
        bidirectional = predict(WanTransformer3DModel.from_pretrained(path), x, t, text)
    assert (expected - without_adapter).abs().max().item() > 1e-3  # the merge is not a no-op
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-5 * scale  # the merge's fp32 rounding
    assert (bidirectional - expected).abs().max().item() > 1e-2


def test_a_pipeline_export_of_a_causal_role_records_it_in_its_transformer(trained_state, tmp_path):
    from fvstep.recipes.tiny_pipeline import save_tiny_pipeline

    base = save_tiny_pipeline(tmp_path / "base")
    export(trained_state, "student", tmp_path / "pipe", base=base, weights="ema", format="pipeline")
    loaded = load_causal(tmp_path / "pipe")
    x, t, text = _probe()
    sampler = FewStepSampler((1.0, 0.5))
    with torch.no_grad(), role_module(trained_state, "student", weights="ema") as module:
        assert torch.equal(predict(loaded, x, t, text), predict(module, x, t, text))
        # what validation samples is what the loaded export samples
        expected = sample(module, x, text, sampler=sampler, key=fs.random.key(3))
    assert torch.equal(sample(loaded, x, text, sampler=sampler, key=fs.random.key(3)), expected)


def test_a_plain_load_of_a_causal_export_is_refused_where_fvstep_computes(tmp_path):
    from diffusers import WanTransformer3DModel

    make_causal(tiny_wan(seed=0), chunk_frames=2).save_pretrained(tmp_path / "causal")
    plain = WanTransformer3DModel.from_pretrained(tmp_path / "causal")
    x, _, text = _probe()
    with pytest.raises(ValueError, match="exported causal .chunk_frames=2. but loaded bidir"):
        chunk_frames_of(plain)
    with pytest.raises(ValueError, match="load_causal"):
        sample(plain, x, text, sampler=FewStepSampler((1.0,)))
    state = fs.TrainState.create({"student": fs.Role(plain)}, key=fs.random.key(0))
    with pytest.raises(ValueError, match="records a causal Wan .* is bidirectional"):
        export(state, "student", tmp_path / "again", format="diffusers")
    assert not (tmp_path / "again").exists()
    with pytest.raises(ValueError, match="records a causal model of chunk_frames=2"):
        make_causal(plain, chunk_frames=1)
    assert chunk_frames_of(make_causal(plain)) == 2  # the recorded chunk restored
    tiny_wan(seed=0).save_pretrained(tmp_path / "bidirectional")
    with pytest.raises(ValueError, match="holds a bidirectional model.*chunk_frames="):
        load_causal(tmp_path / "bidirectional")
    assert chunk_frames_of(load_causal(tmp_path / "bidirectional", chunk_frames=3)) == 3
    assert recorded_chunk_frames(tiny_wan()) is None
    with pytest.raises(ValueError, match="must be"):
        recorded_chunk_frames({CAUSAL_CONFIG_KEY: {"chunk_frames": 0}})


def test_the_recipes_refuse_a_causal_export_for_a_bidirectional_role(tmp_path):
    from fvstep.recipes.init import check_causal_source, init_from
    from fvstep.recipes.options import InitFrom, ModelOptions
    from fvstep.recipes.parts import load_transformer

    causal = make_causal(tiny_wan(seed=0), chunk_frames=1)
    causal.save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match="holds a causal Wan .chunk_frames=1.*bidirectional"):
        init_from(InitFrom(path=str(tmp_path / "causal")), {"student": tiny_wan(seed=1)})
    with pytest.raises(ValueError, match="causal of chunk_frames=2"):
        check_causal_source(tmp_path / "causal", make_causal(tiny_wan(), chunk_frames=2), role="s")
    with pytest.raises(ValueError, match="model.path .* holds a causal Wan"):
        load_transformer(ModelOptions(path=str(tmp_path / "causal")))
    # the same causal model, and a causal student started from a bidirectional Wan: filled
    same = make_causal(tiny_wan(seed=1), chunk_frames=1)
    init_from(InitFrom(path=str(tmp_path / "causal")), {"student": same})
    assert torch.equal(same.state_dict()["proj_out.weight"], causal.state_dict()["proj_out.weight"])
    tiny_wan(seed=2).save_pretrained(tmp_path / "bidirectional")
    init_from(InitFrom(path=str(tmp_path / "bidirectional")), {"student": same})


def _rollout_noise(key, like, chunk):
    """The noise ``rollout`` draws for each chunk (``split(fold_in(key, c), 3)[0]``)."""
    b, c, f, h, w = like.shape
    draws = [
        torch.randn(
            (b, c, chunk, h, w),
            generator=fsrandom.generator(fsrandom.split(fsrandom.fold_in(key, i), 3)[0]),
        )
        for i in range(f // chunk)
    ]
    return torch.cat(draws, 2)


@pytest.mark.parametrize(("chunk", "steps"), [(1, (1.0,)), (1, (1.0, 0.6, 0.3)), (2, (1.0, 0.5))])
def test_sampling_a_causal_student_is_its_rollout_exiting_at_the_last_step(chunk, steps):
    student = make_causal(tiny_wan(seed=0), chunk_frames=chunk)
    batch = synthetic_batch(fs.random.key(1), batch_size=2, frames=2 * chunk + (chunk == 1))
    key = fs.random.key(2)
    num_chunks = batch["latents"].shape[2] // chunk
    with torch.no_grad():
        ro = rollout(
            student,
            batch["latents"],
            batch["text"],
            key,
            exits=(len(steps) - 1,) * num_chunks,
            denoising_steps=steps,
        )
        noise = _rollout_noise(key, batch["latents"], chunk)
        got = sample(student, noise, batch["text"], sampler=FewStepSampler(steps), key=key)
    assert torch.equal(got, ro.video)


def test_euler_sampling_of_a_causal_student_never_reads_a_later_chunk():
    student = make_causal(tiny_wan(seed=0), chunk_frames=1)
    batch = synthetic_batch(fs.random.key(1), batch_size=1, frames=3)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    later = noise.clone()
    later[:, :, 2] += 1.0
    for sampler in (EulerSampler(2), EulerSampler(2, guidance_scale=3.0)):
        a = sample(student, noise, batch["text"], sampler=sampler)
        b = sample(student, later, batch["text"], sampler=sampler)
        first = sample(student, noise[:, :, :2], batch["text"], sampler=sampler)
        assert torch.equal(a[:, :, :2], b[:, :, :2])
        assert not torch.equal(a[:, :, 2], b[:, :, 2])
        # a shorter video: a cache of 2 frames, not 3 (attention over another capacity)
        torch.testing.assert_close(first, a[:, :, :2], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of the chunk"):
        sample(
            make_causal(tiny_wan(), chunk_frames=2), noise, batch["text"], sampler=EulerSampler(1)
        )
    with pytest.raises(ValueError, match="needs a key"):
        sample(student, noise, batch["text"], sampler=FewStepSampler((1.0, 0.5)))


# --- 2 FSDP2-sharded ranks ------------------------------------------------------------------


def check_sharded_causal_export_and_sample(rank: int, world_size: int, directory: str):
    from fvstep import parallel as fsp

    mesh = fsp.make_mesh(device_type="cpu")
    student = fsp.shard_module(make_causal(tiny_wan(seed=0), chunk_frames=1), mesh=mesh)
    state = fs.TrainState.create(
        {"student": fs.Role(student, optimizer=fs.optim.adamw(lr=1e-3))}, key=fs.random.key(0)
    )
    out = Path(directory)
    file = export(state, "student", out / "student.safetensors")
    folder = export(state, "student", out / "student", format="diffusers")
    batch = synthetic_batch(fs.random.key(1), batch_size=2, frames=2)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(4))
    with role_module(state, "student") as module:
        video = sample(
            module, noise, batch["text"], sampler=FewStepSampler((1.0, 0.5)), key=fs.random.key(2)
        )
    return (None if file is None else str(file), None if folder is None else str(folder), video)


@pytest.mark.multirank
def test_a_sharded_causal_student_exports_its_record_and_samples_as_on_one_process(ranks, tmp_path):
    from safetensors import safe_open

    (file, folder, video_0), (none_file, none_folder, video_1) = ranks.run(
        check_sharded_causal_export_and_sample, str(tmp_path)
    )
    assert none_file is None and none_folder is None
    with safe_open(file, "pt") as f:
        assert json.loads(f.metadata()[CAUSAL_METADATA_KEY]) == {"chunk_frames": 1}
    loaded = load_causal(folder)
    plain = make_causal(tiny_wan(seed=0), chunk_frames=1)
    for name, p in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    batch = synthetic_batch(fs.random.key(1), batch_size=2, frames=2)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = sample(
            plain, noise, batch["text"], sampler=FewStepSampler((1.0, 0.5)), key=fs.random.key(2)
        )
    assert torch.equal(video_0, expected) and torch.equal(video_1, expected)
