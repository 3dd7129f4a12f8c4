"""The causal Wan (fvstep.methods.causal_wan): teacher forcing equals the cached rollout,
causality, checkpoint compatibility with the bidirectional model, the rolling cache, the
cache as a value, preparation (checkpointing, compile, FSDP2) and the context-parallel
refusal."""

from __future__ import annotations

import copy

import pytest
import torch

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.core import tree
from fvstep.methods.causal_wan import (
    CausalWanAttnProcessor,
    KVCache,
    causal_forward,
    chunk_frames_of,
    init_cache,
    make_causal,
)
from fvstep.methods.models import tiny_wan
from fvstep.parallel.prepare import prepare

CPU_COMPILE = {"backend": "aot_eager"}


def _inputs(frames: int = 6, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, frames, 4, 4, generator=g)
    text = torch.randn(batch, 3, 16, generator=g)
    return x, text


def _rollout(model, x, t, text, chunk: int, cache: KVCache):
    outs = []
    for start in range(0, x.shape[2], chunk):
        frames = slice(start, start + chunk)
        v, cache = causal_forward(
            model, x[:, :, frames], t[:, frames], text, cache=cache, update_cache=True
        )
        outs.append(v)
    return torch.cat(outs, 2), cache


def test_teacher_forcing_and_the_cached_rollout_give_the_same_frames():
    """One block-causal forward over 3 chunks of 2 frames (each chunk at its own time)
    equals the chunk-by-chunk rollout with the KV cache, and a cached call of the last two
    chunks at once: fp32 on the CPU, within 1e-5 (measured 2.4e-7 of outputs of magnitude
    ~2)."""
    model = make_causal(tiny_wan(seed=0), chunk_frames=2)
    x, text = _inputs()
    t = (torch.rand(2, 3, generator=torch.Generator().manual_seed(1)) * 1000).repeat_interleave(
        2, 1
    )
    with torch.no_grad():
        whole, unchanged = causal_forward(model, x, t, text)
        rolled, cache = _rollout(model, x, t, text, 2, init_cache(model, x, capacity_frames=6))
        first, two_chunks = _rollout(
            model, x[:, :, :2], t[:, :2], text, 2, init_cache(model, x, capacity_frames=6)
        )
        rest, _ = causal_forward(model, x[:, :, 2:], t[:, 2:], text, cache=two_chunks)
    assert unchanged is None
    torch.testing.assert_close(rolled, whole, rtol=0, atol=1e-5)
    # a cached call of two chunks at once: block-causal within it too
    torch.testing.assert_close(torch.cat([first, rest], 2), whole, rtol=0, atol=1e-5)
    assert int(cache.num_frames) == 6


def test_a_frame_never_sees_a_later_chunk_and_one_chunk_is_the_bidirectional_model():
    model = make_causal(tiny_wan(seed=0), chunk_frames=2)
    x, text = _inputs()
    t = torch.full((2,), 500.0)
    later = x.clone()
    later[:, :, 4:] += 1.0
    with torch.no_grad():
        v, _ = causal_forward(model, x, t, text)
        v_later, _ = causal_forward(model, later, t, text)
        whole_chunk = make_causal(tiny_wan(seed=0), chunk_frames=6)
        v_whole = whole_chunk(hidden_states=x, timestep=t, encoder_hidden_states=text)[0]
        v_bidirectional = tiny_wan(seed=0)(hidden_states=x, timestep=t, encoder_hidden_states=text)[
            0
        ]
    assert torch.equal(v_later[:, :, :4], v[:, :, :4])
    assert not torch.equal(v_later[:, :, 4:], v[:, :, 4:])
    assert not torch.allclose(v, v_bidirectional)  # the mask matters
    assert torch.equal(v_whole, v_bidirectional)  # and is the only change


def test_a_bidirectional_checkpoint_loads_into_the_causal_model_and_back(tmp_path):
    from diffusers import WanTransformer3DModel

    bidirectional = tiny_wan(seed=3)
    causal = make_causal(tiny_wan(seed=0))
    assert list(causal.state_dict()) == list(bidirectional.state_dict())
    causal.load_state_dict(bidirectional.state_dict())
    back = tiny_wan(seed=0)
    back.load_state_dict(causal.state_dict())
    tree.assert_trees_equal(dict(back.state_dict()), dict(bidirectional.state_dict()))
    bidirectional.save_pretrained(tmp_path / "wan")
    loaded = make_causal(WanTransformer3DModel.from_pretrained(tmp_path / "wan"))
    x, text = _inputs(frames=3)
    with torch.no_grad():
        a, _ = causal_forward(loaded, x, torch.full((2,), 300.0), text)
        b, _ = causal_forward(causal, x, torch.full((2,), 300.0), text)
    assert torch.equal(a, b)


def test_a_full_rolling_cache_keeps_its_sink_and_its_latest_frames():
    """Capacity 3 frames with a sink of 1, four frames one at a time: the cache holds
    frames 0, 2, 3. The first layer's keys depend on their own frame only, so they equal
    those of an unbounded cache at slots 0, 2, 3."""
    model = make_causal(tiny_wan(seed=0), chunk_frames=1)
    x, text = _inputs(frames=4)
    t = torch.zeros(2, 4)
    with torch.no_grad():
        _, rolling = _rollout(
            model, x, t, text, 1, init_cache(model, x, capacity_frames=3, sink_frames=1)
        )
        _, whole = _rollout(model, x, t, text, 1, init_cache(model, x, capacity_frames=4))
    ft = whole.frame_tokens
    kept = torch.cat([whole.keys[:, 0, :ft], whole.keys[:, 0, 2 * ft :]], 1)
    assert int(rolling.num_frames) == 3 and rolling.capacity_frames == 3
    assert torch.equal(rolling.keys[:, 0], kept)
    with pytest.raises(ValueError, match="do not fit"), torch.no_grad():
        causal_forward(model, x[:, :, :3], t[:, :3], text, cache=rolling, update_cache=True)


def test_the_cache_is_a_value_and_no_module_keeps_it():
    """A call changes no input cache, leaves nothing on the modules (the same call twice
    gives the same bits), and the returned cache is an fvstep pytree of detached tensors."""
    model = make_causal(tiny_wan(seed=0), chunk_frames=3)
    x, text = _inputs(frames=3)
    cache = init_cache(model, x, capacity_frames=6)
    before = tree.clone(cache)
    attributes = {n: dict(vars(m)) for n, m in model.named_modules()}
    first, new = causal_forward(model, x, torch.zeros(2), text, cache=cache, update_cache=True)
    tree.assert_trees_equal(cache, before)
    assert {n: dict(vars(m)) for n, m in model.named_modules()}.keys() == attributes.keys()
    again, _ = causal_forward(model, x, torch.zeros(2), text, cache=before, update_cache=True)
    assert torch.equal(first, again)
    assert all(not leaf.requires_grad for leaf in tree.leaves(new))
    assert len(tree.leaves(new)) == 3 and new.keys.shape[1] == len(model.blocks)
    nxt, _ = causal_forward(model, x, torch.zeros(2), text, cache=new)
    assert not torch.equal(nxt, first)  # the cache is read


def _cached_grads(model) -> dict[str, torch.Tensor]:
    x, text = _inputs(frames=6)
    with torch.no_grad():
        _, cache = causal_forward(
            model,
            x[:, :, :3],
            torch.zeros(2),
            text,
            cache=init_cache(model, x, capacity_frames=6),
            update_cache=True,
        )
    v, _ = causal_forward(model, x[:, :, 3:], torch.full((2,), 700.0), text, cache=cache)
    v.square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("options", [{"checkpointing": "full"}, {"checkpointing": "selective"}])
def test_prepared_checkpointing_gives_the_eager_gradients_bitwise(options):
    """The recomputation gets the call's cache as the blocks' saved argument."""
    eager = _cached_grads(make_causal(tiny_wan(seed=0)))
    prepared = _cached_grads(prepare(make_causal(tiny_wan(seed=0)), **options))
    tree.assert_trees_equal(prepared, eager)


@pytest.mark.heavy
def test_compiled_blocks_give_the_eager_gradients():
    eager = _cached_grads(make_causal(tiny_wan(seed=0)))
    compiled = _cached_grads(
        prepare(make_causal(tiny_wan(seed=0)), checkpointing="selective", compile=CPU_COMPILE)
    )
    tree.assert_trees_close(compiled, eager, rtol=0, atol=1e-6)


def check_fsdp2_causal_rollout_matches_one_process(rank: int, world_size: int):
    mesh = fsp.make_mesh(device_type="cpu")
    plain = make_causal(tiny_wan(seed=0))
    reference = _cached_grads(copy.deepcopy(plain))
    sharded = prepare(plain, mesh=mesh, checkpointing="full")
    grads = {n: fs.tree.full_tensor(g) for n, g in _cached_grads(sharded).items()}
    tree.assert_trees_close(grads, reference, rtol=0, atol=1e-6)  # reduction order only
    return True


@pytest.mark.heavy
@pytest.mark.multirank
def test_an_fsdp2_sharded_causal_wan_gives_the_one_process_gradients(ranks):
    """Also covered in the default suite by the 2-rank self-forcing and streaming tests."""
    assert all(ranks.run(check_fsdp2_causal_rollout_matches_one_process))


def test_context_parallel_and_bad_inputs_are_refused_with_a_clear_error():
    model = make_causal(tiny_wan(seed=0), chunk_frames=3)
    processor = model.blocks[0].attn1.processor
    assert isinstance(processor, CausalWanAttnProcessor)
    with pytest.raises(ValueError, match="context parallel is not supported"):
        processor._parallel_config = object()  # what apply_context_parallel sets
    with pytest.raises(ValueError, match="causal already"):
        make_causal(model)
    with pytest.raises(ValueError, match="chunk_frames"):
        make_causal(tiny_wan(), chunk_frames=0)
    with pytest.raises(ValueError, match="WanTransformer3DModel"):
        make_causal(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="before fvstep.parallel.prepare"):
        make_causal(prepare(tiny_wan()))
    with pytest.raises(ValueError, match="not a causal Wan"):
        chunk_frames_of(tiny_wan())
    x, text = _inputs(frames=3)
    with pytest.raises(ValueError, match="sink_frames"):
        init_cache(model, x, capacity_frames=2, sink_frames=2)
    with pytest.raises(ValueError, match="needs a cache"):
        causal_forward(model, x, torch.zeros(2), text, update_cache=True)
    with pytest.raises(ValueError, match="timestep"):
        causal_forward(model, x, torch.zeros(2, 2), text)
    with pytest.raises(ValueError, match="rotary table"):
        causal_forward(model, torch.zeros(2, 4, 33, 4, 4), torch.zeros(2), text)
    assert chunk_frames_of(model) == 3


def test_a_rollouts_contexts_are_views_of_one_buffer_and_regenerate_its_frames():
    """Each chunk's context is a view of one buffer (without eviction its prefix of the
    final cache; with eviction a window of the start's and the new frames), and the exit
    steps regenerated from them are the rollout's frames, bitwise."""
    from fvstep.methods.causal_rollout import regenerate, rollout
    from fvstep.methods.models import synthetic_batch

    student = make_causal(tiny_wan(seed=0), chunk_frames=1)
    batch = synthetic_batch(fs.random.key(0), batch_size=2, frames=3)
    options = {"exits": (1, 0, 1), "denoising_steps": (1.0, 0.5)}
    key = fs.random.key(1)
    ro = rollout(student, batch["latents"], batch["text"], key, **options)
    assert all(c.keys is ro.cache.keys for c in ro.contexts)
    assert [int(c.num_frames) for c in ro.contexts] == [0, 1, 2]
    again = regenerate(student, ro.exit_inputs, ro.exit_times, ro.contexts, batch["text"])
    assert torch.equal(again, ro.video)
    # a rolling cache (sink 1 + 1 frame) evicts: the contexts are windows of one buffer,
    # from a cache already holding frames (the second call continues the first's)
    rolling = init_cache(student, batch["latents"], capacity_frames=2, sink_frames=1)
    for _ in range(2):
        ro = rollout(student, batch["latents"], batch["text"], key, cache=rolling, **options)
        assert len({id(c.keys) for c in ro.contexts}) == 1
        assert all(c.slots is not None and c.capacity_frames == 2 for c in ro.contexts)
        again = regenerate(student, ro.exit_inputs, ro.exit_times, ro.contexts, batch["text"])
        assert torch.equal(again, ro.video)
        rolling = ro.cache
    with pytest.raises(ValueError, match="cannot append to a KVCache with slots"):
        x, t = batch["latents"][:, :, :1], torch.zeros(2, 1)
        causal_forward(student, x, t, batch["text"], cache=ro.contexts[1], update_cache=True)


def test_the_cache_takes_the_autocast_dtype_its_keys_are_computed_in():
    latents = torch.zeros(1, 4, 2, 4, 4)
    model = make_causal(tiny_wan())
    assert init_cache(model, latents, capacity_frames=2).keys.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert init_cache(model, latents, capacity_frames=2).keys.dtype == torch.bfloat16
    cache = init_cache(model, latents, capacity_frames=2, dtype=torch.float16)
    assert cache.keys.dtype == torch.float16


def test_make_causal_records_its_chunk_in_the_config_and_nothing_else_changes():
    from fvstep.methods.causal_wan import CAUSAL_CONFIG_KEY, is_causal, recorded_chunk_frames

    plain = tiny_wan(seed=0)
    causal = make_causal(tiny_wan(seed=0), chunk_frames=2)
    assert dict(causal.config)[CAUSAL_CONFIG_KEY] == {"chunk_frames": 2}
    assert {k: v for k, v in causal.config.items() if k != CAUSAL_CONFIG_KEY} == dict(plain.config)
    assert recorded_chunk_frames(causal) == 2 and recorded_chunk_frames(plain) is None
    assert is_causal(causal) and not is_causal(plain)
    assert list(causal.state_dict()) == list(plain.state_dict())
    assert chunk_frames_of(make_causal(tiny_wan())) == 3  # the default without a record
