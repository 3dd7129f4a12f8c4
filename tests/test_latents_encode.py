"""``fvstep data encode``: tiny real models (a diffusers AutoencoderKLWan and a UMT5
encoder built from configs, transformers' ByT5 byte tokenizer, which needs no vocabulary
file) on a few generated clips; nothing is downloaded."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from fvstep.executor.latents import LatentDataset, encode_clips, find_clips, shard_name
from fvstep.executor.latents.clips import fit_frames, read_frames

MAX_TOKENS = 32
# name: (frames, height, width, kind)
CLIPS = {
    "a.mp4": (5, 16, 32, "video"),
    "b.mp4": (5, 16, 32, "video"),
    "c.mp4": (4, 16, 32, "video"),  # 4 frames -> 1 kept: another latent shape
    "sub/d": (5, 16, 16, "frames"),  # a folder of PNGs
    "sub/e.mp4": (5, 16, 32, "video"),
}


@pytest.fixture(scope="module")
def models():
    from diffusers import AutoencoderKLWan
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.5, 2.0, 1.0],
    ).eval()
    config = UMT5Config(vocab_size=384, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    text_encoder = UMT5EncoderModel(config).eval()
    return vae, text_encoder, ByT5Tokenizer()


def write_video(path, frames) -> None:
    import av  # imageio's PyAV plugin would do, but runs gc.collect() on close (slow here)

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    import imageio.v3 as iio

    root = tmp_path_factory.mktemp("clips")
    rng = np.random.RandomState(0)
    for name, (t, h, w, kind) in CLIPS.items():
        frames = (rng.rand(t, h, w, 3) * 255).astype(np.uint8)
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "video":
            write_video(path, frames)
            path.with_suffix(".txt").write_text(f"a clip called {name}\n")
        else:
            path.mkdir()
            for i, frame in enumerate(frames):
                iio.imwrite(path / f"{i:03d}.png", frame)
            (path.parent / f"{path.name}.txt").write_text(f"frames called {name}")
    return root


def encode(clips, out, models, **kw):
    vae, te, tok = models
    options = dict(max_tokens=MAX_TOKENS, shard_size=2, batch_size=2, dtype=torch.float32)
    return encode_clips(clips, out, vae=vae, text_encoder=te, tokenizer=tok, **{**options, **kw})


def assert_datasets_equal(a: LatentDataset, b: LatentDataset) -> None:
    assert len(a) == len(b) and a.shards == b.shards
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for name in x:
            same = (
                torch.equal(x[name], y[name])
                if isinstance(x[name], torch.Tensor)
                else x[name] == y[name]
            )
            assert same, (i, name)


@pytest.fixture(scope="module")
def reference(clips, models, tmp_path_factory):
    """The whole folder encoded by one rank in one go."""
    out = tmp_path_factory.mktemp("reference")
    result = encode(clips, out, models)
    assert result.written == [shard_name(k) for k in range(3)] and result.skipped == []
    return LatentDataset(out)


def test_encode_finds_clips_with_captions_in_key_order(clips):
    found = find_clips(clips)
    assert [c.key for c in found] == sorted(CLIPS)
    assert found[3].kind == "frames" and found[3].caption == "frames called sub/d"
    assert found[0].caption == "a clip called a.mp4"


def test_encoded_samples_are_the_models_outputs(reference, clips, models):
    vae, te, tok = models
    ds = reference
    assert [ds[i]["key"] for i in range(len(ds))] == sorted(CLIPS)
    assert [s["latents"] for s in ds.shapes] == [
        (4, 2, 2, 4),
        (4, 2, 2, 4),
        (4, 1, 2, 4),
        (4, 2, 2, 2),
        (4, 2, 2, 4),
    ]
    # Item 2 by hand: first frames cut to 4k+1, VAE mean, Wan's normalisation.
    clip = find_clips(clips)[2]
    pixels = fit_frames(read_frames(clip), temporal_factor=4, multiple=16)
    x = pixels.permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
        std = torch.tensor([1.5, 0.5, 2.0, 1.0]).view(1, 4, 1, 1, 1)
        expected = ((z - mean) / std)[0]
        tokens = tok(
            [clip.caption],
            padding="max_length",
            max_length=MAX_TOKENS,
            truncation=True,
            return_tensors="pt",
        )
        hidden = te(tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state[0]
    sample = ds[2]
    torch.testing.assert_close(sample["latents"], expected, rtol=1e-5, atol=1e-5)
    n = sample["text_length"]
    assert n == len(clip.caption.encode()) + 1 == int(tokens.attention_mask.sum())  # + </s>
    torch.testing.assert_close(sample["text"][:n], hidden[:n], rtol=1e-5, atol=1e-5)
    assert not sample["text"][n:].any()  # zero past the caption, as WanPipeline does
    assert sample["caption"] == clip.caption


def test_encode_on_two_ranks_resumed_on_one_equals_one_rank(reference, clips, models, tmp_path):
    # Rank 0 of 2 finishes; rank 1 is "killed" mid-shard (a temporary file is left).
    first = encode(clips, tmp_path, models, rank=0, world_size=2)
    assert first.written == [shard_name(0), shard_name(2)] and first.index is None
    with pytest.raises(FileNotFoundError, match="encode has not finished"):
        LatentDataset(tmp_path)
    (tmp_path / f"{shard_name(1)}.tmp-99999").write_bytes(b"half a shard")
    kept = (tmp_path / shard_name(0)).stat()
    # Rerun with one rank: only the missing shard is encoded.
    second = encode(clips, tmp_path, models)
    assert second.skipped == [shard_name(0), shard_name(2)] and second.written == [shard_name(1)]
    assert second.index is not None
    assert (tmp_path / shard_name(0)).stat().st_mtime_ns == kept.st_mtime_ns  # not redone
    assert not list(tmp_path.glob("*.tmp-*"))
    assert_datasets_equal(LatentDataset(tmp_path), reference)
    # A third run finds everything done.
    third = encode(clips, tmp_path, models)
    assert third.written == [] and len(third.skipped) == 3


def test_rank_one_of_two_writes_the_index_when_it_finishes_last(reference, clips, models, tmp_path):
    assert encode(clips, tmp_path, models, rank=0, world_size=2).index is None
    assert encode(clips, tmp_path, models, rank=1, world_size=2).index is not None
    assert_datasets_equal(LatentDataset(tmp_path), reference)


def test_a_damaged_finished_shard_is_encoded_again(reference, clips, models, tmp_path):
    shutil.copytree(reference.root, tmp_path, dirs_exist_ok=True)
    shard = tmp_path / shard_name(1)
    shard.write_bytes(shard.read_bytes()[:50])
    result = encode(clips, tmp_path, models)
    assert result.written == [shard_name(1)]
    assert_datasets_equal(LatentDataset(tmp_path), reference)


@pytest.mark.parametrize(
    ("change", "differ"),
    [
        ({"num_frames": 5}, "num_frames"),
        ({"height": 16, "width": 16}, "height.*width"),
        ({"multiple": 8}, "multiple"),
        ({"max_tokens": MAX_TOKENS // 2}, "max_tokens"),
        ({"dtype": torch.bfloat16}, "dtype"),
        ({"shard_size": 3}, "shard_size"),
    ],
)
def test_encode_refuses_to_mix_settings(reference, clips, models, tmp_path, change, differ):
    shutil.copytree(reference.root, tmp_path, dirs_exist_ok=True)
    with pytest.raises(ValueError, match=f"other settings.*{differ}"):
        encode(clips, tmp_path, models, **change)


def test_encode_checks_num_frames(clips, models, tmp_path):
    with pytest.raises(ValueError, match="num_frames must be k \\* 4 \\+ 1"):
        encode(clips, tmp_path / "new", models, num_frames=6)


def test_encode_refuses_one_of_height_and_width_before_writing_anything(clips, models, tmp_path):
    with pytest.raises(ValueError, match="give both height and width"):
        encode(clips, tmp_path / "new", models, height=32)
    assert not (tmp_path / "new").exists()


def rank_zero_of_two(reference, out) -> None:
    """What rank 0 of 2 leaves (shards 0 and 2, ``encode.json``; bitwise, as tested above)."""
    out.mkdir(exist_ok=True)
    for name in (shard_name(0), shard_name(2), "encode.json"):
        shutil.copy2(reference.root / name, out / name)


def other_models(models, which):
    """Fresh copies of the fixture's models, one of them changed as ``which`` says."""
    from diffusers import AutoencoderKLWan
    from transformers import ByT5Tokenizer

    vae, te, tok = copy.deepcopy(models)
    if which == "bfloat16":  # case A: the same weights, run in bf16
        vae, te = vae.to(torch.bfloat16), te.to(torch.bfloat16)
    elif which == "vae weights":  # case B: the same config, other weights
        with torch.no_grad():
            next(vae.parameters()).add_(0.01)
    elif which == "text encoder weights":
        with torch.no_grad():
            te.shared.weight.mul_(1.01)
    elif which == "vae normalisation":  # the same weights, other latents_std
        config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
        vae = AutoencoderKLWan(**{**config, "latents_std": [1.0, 1.0, 1.0, 1.0]}).eval()
        vae.load_state_dict(models[0].state_dict())
    elif which == "tokenizer":  # another vocabulary (no sentinel tokens)
        tok = ByT5Tokenizer(extra_ids=0)
    return vae, te, tok


@pytest.mark.parametrize(
    ("which", "differ"),
    [
        ("bfloat16", "models.text_encoder.dtype.*models.vae.dtype"),
        ("vae weights", "models.vae.weights_sha256"),
        ("text encoder weights", "models.text_encoder.weights_sha256"),
        ("vae normalisation", "models.vae.config_sha256"),
        ("tokenizer", "models.tokenizer.config_sha256"),
    ],
)
def test_a_rerun_with_other_models_is_refused_on_every_rank_before_any_shard(
    reference, clips, models, tmp_path, which, differ
):
    rank_zero_of_two(reference, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    changed = other_models(models, which)
    for rank in (1, 0):
        with pytest.raises(ValueError, match=f"other settings: .*{differ}"):
            encode(clips, tmp_path, changed, rank=rank, world_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no shard, no index
    assert encode(clips, tmp_path, models, rank=1, world_size=2).index is not None
    assert_datasets_equal(LatentDataset(tmp_path), reference)


def test_the_refusal_names_each_difference_with_both_values(reference, clips, models, tmp_path):
    rank_zero_of_two(reference, tmp_path)
    with pytest.raises(ValueError) as refused:
        encode(clips, tmp_path, other_models(models, "bfloat16"), rank=1, world_size=2)
    message = str(refused.value)
    assert "models.vae.dtype: 'float32' in encode.json, 'bfloat16' now" in message
    assert "models.vae.weights_sha256" in message and "models.vae.config_sha256" not in message
    assert "use another output folder" in message


def test_of_two_ranks_starting_at_once_with_other_settings_one_is_refused(tmp_path, monkeypatch):
    from pathlib import Path

    from fvstep.executor.latents.encode_identity import agree_on_settings

    agree_on_settings(tmp_path, {"dtype": "float32"})  # the first rank
    # The second looked before the first had published, and found no encode.json.
    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: p.name != "encode.json" and exists(p))
    with pytest.raises(ValueError, match="dtype: 'float32' in encode.json, 'bfloat16' now"):
        agree_on_settings(tmp_path, {"dtype": "bfloat16"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encode.json"]


def test_an_identical_rerun_with_reloaded_models_is_accepted_and_bitwise(
    reference, clips, models, tmp_path
):
    rank_zero_of_two(reference, tmp_path)
    vae, te, tok = models
    pipeline = tmp_path.parent / f"{tmp_path.name}-pipeline"
    vae.save_pretrained(pipeline / "vae")
    te.save_pretrained(pipeline / "text_encoder")
    reloaded = (
        type(vae).from_pretrained(pipeline / "vae").eval(),
        type(te).from_pretrained(pipeline / "text_encoder").eval(),
        type(tok)(),
    )
    result = encode(clips, tmp_path, reloaded, rank=1, world_size=2)
    assert result.written == [shard_name(1)] and result.index is not None
    assert_datasets_equal(LatentDataset(tmp_path), reference)
    settings = json.loads((tmp_path / "encode.json").read_text())
    assert settings["models"]["vae"]["dtype"] == "float32"
    assert settings["models"]["vae"]["device"] == "cpu"


def test_the_weights_digest_covers_every_byte_once_in_name_order(monkeypatch):
    from fvstep.executor.latents import encode_identity

    monkeypatch.setattr(encode_identity, "_CHUNK_BYTES", 48)  # several pieces a tensor
    digest = encode_identity._weights_digest

    def build(order):
        torch.manual_seed(0)
        layers = {name: torch.nn.Linear(4, 4) for name in ("x", "y")}
        module = torch.nn.Module()
        for name in order:  # registered in another order, same names and weights
            module.add_module(name, layers[name])
        return module

    a, b = build("xy"), build("yx")
    assert digest(a) == digest(b) == digest(copy.deepcopy(a))
    with torch.no_grad():
        b.y.weight[-1, -1] += 1  # the last byte of a tensor of several pieces
    assert digest(b) != digest(a)
    tied = build("xy")
    tied.z = tied.x  # a tied module: recorded as such, its bytes hashed once
    assert digest(tied) != digest(a) and digest(tied) == digest(copy.deepcopy(tied))
    assert digest(a.half()) != digest(build("xy"))  # the weights as loaded, in their dtype


def test_models_in_training_mode_encode_as_in_eval_mode_and_keep_their_mode(
    reference, clips, models, tmp_path
):
    vae, te, tok = copy.deepcopy(models)
    vae.train(), te.train()  # UMT5's dropout (0.1) is active in training mode
    encode(clips, tmp_path, (vae, te, tok))
    assert_datasets_equal(LatentDataset(tmp_path), reference)
    assert all(m.training for m in [*vae.modules(), *te.modules()])


def test_a_clip_without_caption_is_named(clips, models, tmp_path):
    source = tmp_path / "clips"
    shutil.copytree(clips, source)
    (source / "b.txt").unlink()
    with pytest.raises(ValueError, match="1 clip\\(s\\) .* have no caption \\('b.mp4'\\)"):
        encode(source, tmp_path / "out", models)


def test_cli_encodes_a_pipeline_folder_like_the_library(reference, clips, models, tmp_path, capsys):
    from fvstep.cli import main

    vae, te, tok = models
    pipeline = tmp_path / "pipeline"
    vae.save_pretrained(pipeline / "vae")
    te.save_pretrained(pipeline / "text_encoder")
    tok.save_pretrained(pipeline / "tokenizer")
    out = tmp_path / "out"
    args = ["data", "encode", str(clips), str(out), "--model", str(pipeline)]
    args += [
        "--max-tokens",
        str(MAX_TOKENS),
        "--shard-size",
        "2",
        "--batch-size",
        "2",
        "--dtype",
        "float32",
    ]
    assert main(args) == 0
    assert "5 clips in 3 shards" in capsys.readouterr().out
    assert_datasets_equal(LatentDataset(out), reference)
    # The same command again (models loaded anew) is accepted; in bf16 it is refused.
    assert main(args) == 0
    assert "wrote 0 and found 3 of its 3 finished" in capsys.readouterr().out
    assert main([*args, "--model-dtype", "bfloat16"]) == 1
    assert "models.vae.dtype: 'float32' in encode.json, 'bfloat16' now" in capsys.readouterr().err
    assert main([*args[:4], "--model", str(pipeline), "--height", "8"]) == 2
    assert "give both --height and --width" in capsys.readouterr().err
