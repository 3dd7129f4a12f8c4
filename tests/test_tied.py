"""Tied parameters and buffers: one tensor held under several names within one role.

The laws: a tied tensor is one leaf (under its first name) with its aliases recorded as
static metadata; a step is bitwise ``torch.optim`` on the same module (one moment per
tensor); a checkpoint load and a clone keep the tie once adopted, so a resumed run is
bitwise an uninterrupted one; an export loads back with a strict ``load_state_dict``.
On 2 FSDP2-sharded gloo ranks the same holds; ties across FSDP2 groups or roles, and
different tensors sharing storage, are refused.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.checkpoint import checkpoint_dir, load, save
from fvstep.checkpoint.exporting import export, gather_weights
from fvstep.core import tree
from fvstep.core.state import adopt
from fvstep.testing import assert_resume_exact

WIDTH = 4
NUM_STEPS = 4


class TiedAutoencoder(nn.Module):
    """An encoder/decoder pair sharing one weight (untied biases), a block between them,
    and a call counter buffer shared by both (read by the decoder, bumped by the encoder:
    if a load untied it, the decoder would read a stale count)."""

    def __init__(self, seed: int = 0, width: int = WIDTH) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.enc = nn.Linear(width, width)
            self.blocks = nn.ModuleList([nn.Linear(width, width)])
            self.dec = nn.Linear(width, width)
        self.dec.weight = self.enc.weight
        self.enc.register_buffer("calls", torch.zeros(()))
        self.dec.register_buffer("calls", self.enc.calls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.enc.calls.add_(1.0)
        h = torch.tanh(self.blocks[0](torch.tanh(self.enc(x))))
        return self.dec(h) * (1.0 + 0.01 * self.dec.calls)


def batch_at(step: int, rank: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return {"x": torch.randn(3, WIDTH, generator=gen), "y": torch.randn(3, WIDTH, generator=gen)}


class Data:
    def batch(self, step: int, *, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        return batch_at(step, rank)


def loss_fn(state: fs.TrainState, batch: dict, key: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(state.module("ae")(batch["x"]), batch["y"])


def make_state(module: nn.Module, optimizer=None) -> fs.TrainState:
    optimizer = optimizer or fs.optim.adamw(lr=1e-2, weight_decay=0.1)
    return fs.TrainState.create({"ae": fs.Role(module, optimizer=optimizer)}, key=fs.random.key(0))


def make_step() -> fs.Step:
    return fs.compile(fs.update("ae", loss_fn))


def torch_loop(module: nn.Module, opt: torch.optim.Optimizer, num_steps: int, rank: int = 0):
    for i in range(num_steps):
        batch = batch_at(i, rank)
        F.mse_loss(module(batch["x"]), batch["y"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def assert_moments_equal(opt_state, opt: torch.optim.Optimizer, module: nn.Module) -> None:
    theirs = {n: opt.state[p] for n, p in module.named_parameters()}
    for name in ("exp_avg", "exp_avg_sq", "step"):
        tree.assert_trees_equal(getattr(opt_state, name), {n: s[name] for n, s in theirs.items()})


# --- (a) structure ----------------------------------------------------------------------


def test_a_tied_tensor_is_one_leaf_under_its_first_name_with_the_alias_recorded():
    module = TiedAutoencoder()
    role = make_state(module).role("ae")
    assert list(role.params) == [
        "enc.weight",
        "enc.bias",
        "blocks.0.weight",
        "blocks.0.bias",
        "dec.bias",
    ]
    assert list(role.params) == [n for n, _ in module.named_parameters()]
    assert list(role.buffers) == ["enc.calls"]
    assert role.tied == (("dec.weight", "enc.weight"), ("dec.calls", "enc.calls"))
    assert role.params["enc.weight"] is module.dec.weight
    assert set(role.opt_state.exp_avg) == set(role.trainable_names) == set(role.params)
    paths = tree.flatten_with_paths(role)[0]
    assert not any("dec.weight" in p or "dec.calls" in p for p in paths)


def test_a_submodule_used_twice_ties_all_of_its_tensors():
    shared = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    module = nn.ModuleDict({"a": shared, "b": nn.Linear(2, 2), "c": shared})
    role = make_state(module).role("ae")
    assert set(role.params) == {
        "a.0.weight",
        "a.0.bias",
        "a.1.weight",
        "a.1.bias",
        "b.weight",
        "b.bias",
    }
    assert set(role.buffers) == {"a.1.running_mean", "a.1.running_var", "a.1.num_batches_tracked"}
    assert dict(role.tied) == {
        **{f"c.{n}": f"a.{n}" for n in ("0.weight", "0.bias", "1.weight", "1.bias")},
        **{f"c.1.{n}": f"a.1.{n}" for n in ("running_mean", "running_var", "num_batches_tracked")},
    }


def test_a_buffer_that_is_a_parameter_is_tied_to_the_parameter():
    module = nn.Linear(2, 2)
    module.register_buffer("weight_copy", module.weight)
    role = make_state(module).role("ae")
    assert role.tied == (("weight_copy", "weight"),) and role.buffers == {}
    clone = tree.clone(role)
    live = adopt(clone).role.module
    assert live.weight_copy is live.weight is clone.params["weight"]


# --- (b) one moment per tensor: bitwise torch.optim ------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["adamw", "adamw-foreach", "adamw-fused", "adamw-amsgrad", "sgd-momentum"],
)
def test_steps_are_bitwise_torch_optim_on_the_same_tied_module(kind):
    module = TiedAutoencoder(seed=1)
    reference = copy.deepcopy(module)
    assert reference.dec.weight is reference.enc.weight
    options = {
        "adamw": {},
        "adamw-foreach": {"foreach": True},
        "adamw-fused": {"fused": True},
        "adamw-amsgrad": {"amsgrad": True},
    }
    if kind == "sgd-momentum":
        ours = fs.optim.sgd(lr=1e-2, momentum=0.9, weight_decay=0.1)
        opt = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.1)
    else:
        ours = fs.optim.adamw(lr=1e-2, weight_decay=0.1, **options[kind])
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, **options[kind])
    state = make_state(module, ours)
    step = make_step()
    for i in range(NUM_STEPS):
        state, _ = step(state, batch_at(i))
    torch_loop(reference, opt, NUM_STEPS)

    role = state.role("ae")
    tree.assert_trees_equal(role.params, dict(reference.named_parameters()))
    tree.assert_trees_equal(role.buffers, dict(reference.named_buffers()))
    assert float(role.buffers["enc.calls"]) == NUM_STEPS
    if kind == "sgd-momentum":
        theirs = {n: opt.state[p]["momentum_buffer"] for n, p in reference.named_parameters()}
        tree.assert_trees_equal(role.opt_state.momentum_buffer, theirs)
    else:
        assert_moments_equal(role.opt_state, opt, reference)
    assert module.dec.weight is module.enc.weight is role.params["enc.weight"]


def test_clipping_counts_a_tied_gradient_once():
    module = TiedAutoencoder(seed=2)
    reference = copy.deepcopy(module)
    state = make_state(module)
    step = fs.compile(fs.update("ae", loss_fn), clip=fs.clip_grad_norm(0.05))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(NUM_STEPS):
        state, metrics = step(state, batch_at(i))
        batch = batch_at(i)
        F.mse_loss(reference(batch["x"]), batch["y"]).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        tree.assert_trees_equal(metrics["ae/grad_norm"], norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    tree.assert_trees_equal(state.role("ae").params, dict(reference.named_parameters()))


# --- (c) checkpoints keep the tie; resume is exact -------------------------------------


def trained_state(seed: int = 0, num_steps: int = 2) -> fs.TrainState:
    state = make_state(TiedAutoencoder(seed))
    step = make_step()
    for i in range(num_steps):
        state, _ = step(state, batch_at(i))
    return state


def test_load_ties_the_loaded_tensor_into_every_aliased_slot(tmp_path):
    state = trained_state()
    path = save(state, checkpoint_dir(tmp_path, 2))
    like = make_state(TiedAutoencoder(seed=5))
    loaded = load(path, like=like)
    tree.assert_trees_equal(loaded, state, check_static=False)
    module = loaded.module("ae")
    role = loaded.role("ae")
    assert module.enc.weight is module.dec.weight is role.params["enc.weight"]
    assert module.enc.calls is module.dec.calls is role.buffers["enc.calls"]
    with torch.no_grad():
        role.params["enc.weight"].add_(1.0)
        role.buffers["enc.calls"].add_(1.0)
    torch.testing.assert_close(module.dec.weight, state.role("ae").params["enc.weight"] + 1.0)
    assert float(module.dec.calls) == float(state.role("ae").buffers["enc.calls"]) + 1.0


def test_a_step_after_load_is_bitwise_a_step_without_the_round_trip(tmp_path):
    state = trained_state()
    path = save(state, checkpoint_dir(tmp_path, 2))
    loaded = load(path, like=make_state(TiedAutoencoder(seed=5)))
    expected, _ = make_step()(state, batch_at(2))
    resumed, _ = make_step()(loaded, batch_at(2))
    tree.assert_trees_equal(resumed, expected, check_static=False)


def tied_factory():
    return make_state(TiedAutoencoder(seed=3)), make_step(), Data()


def test_a_resumed_run_is_bitwise_an_uninterrupted_one(tmp_path):
    final = assert_resume_exact(tied_factory, num_steps=5, interruptions=[2, 4], workdir=tmp_path)
    assert float(final.role("ae").buffers["enc.calls"]) == 5


# --- (d) clones ------------------------------------------------------------------------


def test_a_clone_keeps_the_tie_once_adopted():
    state = trained_state()
    snapshot = tree.clone(state)
    assert snapshot.role("ae").tied == state.role("ae").tied
    module = snapshot.module("ae")
    role = snapshot.role("ae")
    assert module.enc.weight is module.dec.weight is role.params["enc.weight"]
    assert module.enc.calls is module.dec.calls is role.buffers["enc.calls"]
    assert role.params["enc.weight"] is not state.role("ae").params["enc.weight"]


def test_a_step_on_a_clone_is_bitwise_a_step_on_the_original():
    state = trained_state()
    snapshot = tree.clone(state)
    from_clone, _ = make_step()(snapshot, batch_at(2))
    from_original, _ = make_step()(state, batch_at(2))
    tree.assert_trees_equal(from_clone, from_original)


def test_adopt_re_ties_a_module_whose_tie_was_broken():
    state = make_state(TiedAutoencoder())
    module = state.role("ae").role.module
    module.dec.weight = nn.Parameter(module.enc.weight.detach().clone())
    snapshot = tree.clone(state)
    assert snapshot.module("ae").dec.weight is snapshot.role("ae").params["enc.weight"]


# --- export ----------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["params", "ema"])
def test_export_loads_back_with_a_strict_load_state_dict(tmp_path, weights):
    from safetensors.torch import load_file

    module = TiedAutoencoder(seed=4)
    state = fs.TrainState.create(
        {"ae": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-2), ema=fs.EMA(0.5))},
        key=fs.random.key(0),
    )
    step = make_step()
    for i in range(2):
        state, _ = step(state, batch_at(i))
    target = export(state, "ae", tmp_path, weights=weights)
    exported = load_file(str(target))
    assert set(exported) == set(module.state_dict())
    fresh = TiedAutoencoder(seed=9)
    fresh.load_state_dict(exported, strict=True)
    assert fresh.dec.weight is fresh.enc.weight
    source = state.role("ae").ema.params if weights == "ema" else state.role("ae").params
    tree.assert_trees_equal(exported["dec.weight"], source["enc.weight"].detach())
    tree.assert_trees_equal(exported["enc.weight"], source["enc.weight"].detach())
    sd = gather_weights(state, "ae", weights=weights, dtype=torch.bfloat16)
    assert sd is not None and set(sd) == set(module.state_dict())
    assert (
        sd["dec.weight"].untyped_storage().data_ptr()
        != sd["enc.weight"].untyped_storage().data_ptr()
    )
    assert (
        torch.equal(sd["dec.weight"], sd["enc.weight"]) and sd["dec.weight"].dtype == torch.bfloat16
    )


def test_export_diffusers_writes_every_name_of_a_tied_weight(tmp_path):
    diffusers = pytest.importorskip("diffusers")

    class TiedModel(diffusers.ModelMixin, diffusers.ConfigMixin):
        @diffusers.configuration_utils.register_to_config
        def __init__(self, width: int = WIDTH) -> None:
            super().__init__()
            self.enc = nn.Linear(width, width)
            self.dec = nn.Linear(width, width)
            self.dec.weight = self.enc.weight

    module = TiedModel()
    state = make_state(module)
    with torch.no_grad():
        state.role("ae").params["enc.weight"].add_(1.0)
    export(state, "ae", tmp_path / "out", format="diffusers")
    loaded = TiedModel.from_pretrained(tmp_path / "out")
    # diffusers (0.42) loads the two names as two tensors: the values are right, but a
    # model that ties weights must re-tie them itself after from_pretrained.
    for name in ("enc.weight", "dec.weight"):
        tree.assert_trees_equal(loaded.get_parameter(name).detach(), module.enc.weight.detach())


# --- refusals --------------------------------------------------------------------------


def test_different_tensors_sharing_storage_in_one_role_are_refused():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module[1].weight = nn.Parameter(module[0].weight.detach()[:, :].view(2, 2))
    with pytest.raises(
        ValueError, match=r"'0\.weight' and '1\.weight' are different tensors that share storage"
    ):
        make_state(module)


def test_a_non_persistent_buffer_holding_a_state_tensor_is_refused():
    module = nn.Linear(2, 2)
    module.register_buffer("cache", module.weight, persistent=False)
    with pytest.raises(ValueError, match="non-persistent buffer 'cache' is 'weight'"):
        make_state(module)


def test_a_tie_across_roles_is_still_refused():
    a, b = TiedAutoencoder(0), TiedAutoencoder(1)
    b.dec.weight = a.enc.weight
    with pytest.raises(ValueError, match="roles 'a' and 'b' share"):
        fs.TrainState.create(
            {"a": fs.Role(a, optimizer=fs.optim.adamw()), "b": fs.Role(b)}, key=fs.random.key(0)
        )


# --- (e) random tie patterns ------------------------------------------------------------


class RandomTies(nn.Module):
    """``num_layers`` square linear layers applied in turn, some sharing an earlier
    layer's weight, bias or whole module; a persistent buffer per layer, some shared."""

    def __init__(self, seed: int, width: int, ties: list[tuple[int, int, int, int]]) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers = []
            for i, (module_from, weight_from, bias_from, buffer_from) in enumerate(ties):
                if module_from < i:
                    layers.append(layers[module_from])
                    continue
                layer = nn.Linear(width, width)
                layer.register_buffer("scale", torch.rand(()) + 0.5)
                if weight_from < i:
                    layer.weight = layers[weight_from].weight
                if bias_from < i:
                    layer.bias = layers[bias_from].bias
                if buffer_from < i:
                    layer.scale = layers[buffer_from].scale
                layers.append(layer)
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * layer.scale
        return x


@st.composite
def random_ties(draw):
    num_layers = draw(st.integers(1, 4))
    earlier = [st.integers(0, i) for i in range(num_layers)]  # i: not tied
    return [
        (draw(e), draw(e), draw(e), draw(e)) if draw(st.booleans()) else (i, i, i, i)
        for i, e in enumerate(earlier)
    ]


def identity_pattern(module: nn.Module) -> dict[str, str]:
    """Each state_dict name of ``module`` -> the first name under which its tensor appears."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(t), n) for n, t in module.state_dict(keep_vars=True).items()}


@settings(max_examples=15, deadline=None)
@given(ties=random_ties(), seed=st.integers(0, 2**16))
def test_random_tie_patterns_give_one_leaf_per_tensor_and_torch_optim_steps(ties, seed):
    module = RandomTies(seed, WIDTH, ties)
    reference = copy.deepcopy(module)
    pattern = identity_pattern(module)
    state = fs.TrainState.create(
        {"ae": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-2, weight_decay=0.1))},
        key=fs.random.key(seed),
    )
    role = state.role("ae")
    assert set(role.params) | set(role.buffers) == set(pattern.values())
    assert dict(role.tied) == {a: c for a, c in pattern.items() if a != c}

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    step = make_step()
    state, _ = step(state, batch_at(0))
    snapshot = tree.clone(state)
    state, _ = step(state, batch_at(1))
    torch_loop(reference, opt, 2)
    tree.assert_trees_equal(state.role("ae").params, dict(reference.named_parameters()))
    assert_moments_equal(state.role("ae").opt_state, opt, reference)

    snapshot_module = snapshot.module("ae")
    assert identity_pattern(snapshot_module) == pattern
    leaves = {**snapshot.role("ae").params, **snapshot.role("ae").buffers}
    live = snapshot_module.state_dict(keep_vars=True)
    assert all(live[n] is leaves[c] for n, c in pattern.items())


# --- FSDP2: 2 gloo ranks ---------------------------------------------------------------


def sharded_tied(seed: int) -> nn.Module:
    """Blocks in their own FSDP2 groups; enc and dec (the tie) in the root's group."""
    return fsp.shard_module(TiedAutoencoder(seed), mesh=fsp.make_mesh(device_type="cpu"))


def check_fsdp2_tied_against_torch(rank: int, world_size: int, workdir: str) -> bool:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    module = sharded_tied(7)
    assert isinstance(module.enc.weight, DTensor) and module.dec.weight is module.enc.weight
    state = make_state(module)
    assert state.role("ae").tied == (("dec.weight", "enc.weight"), ("dec.calls", "enc.calls"))
    step = make_step()
    for i in range(NUM_STEPS):
        state, _ = step(state, batch_at(i, rank), parallelism=fsp.Layout())

    reference = TiedAutoencoder(7)
    mesh = fsp.make_mesh(device_type="cpu")
    fully_shard(reference.blocks[0], mesh=mesh)
    fully_shard(reference, mesh=mesh)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    torch_loop(reference, opt, NUM_STEPS, rank)
    tree.assert_trees_equal(state.role("ae").params, dict(reference.named_parameters()))
    assert_moments_equal(state.role("ae").opt_state, opt, reference)

    path = save(state, checkpoint_dir(Path(workdir) / "ck", NUM_STEPS))
    loaded = load(path, like=make_state(sharded_tied(8)))
    tree.assert_trees_equal(loaded, state, check_static=False)
    # Sharded parameters cannot be swapped: adopt copies the loaded values into the live
    # DTensor, which fully_shard holds in both slots.
    live = loaded.module("ae")
    assert live.dec.weight is live.enc.weight
    tree.assert_trees_equal(live.enc.weight, loaded.role("ae").params["enc.weight"])

    # Export gathers the tied DTensor once (the same collectives on every rank).
    sd = gather_weights(loaded, "ae", rank0_only=False)
    assert sd is not None and set(sd) == set(TiedAutoencoder().state_dict())
    assert torch.equal(sd["dec.weight"], loaded.role("ae").params["enc.weight"].full_tensor())

    assert_resume_exact(
        lambda: (make_state(sharded_tied(3)), make_step(), Data()),
        num_steps=4,
        interruptions=[2],
        workdir=Path(workdir) / "resume",
    )
    return True


@pytest.mark.multirank
def test_fsdp2_tied_steps_are_torch_optim_and_checkpoints_keep_the_tie(ranks):
    with tempfile.TemporaryDirectory() as workdir:
        assert ranks.run(check_fsdp2_tied_against_torch, workdir) == [True, True]


def check_tie_across_fsdp2_groups_is_refused(rank: int, world_size: int) -> str:
    def own_group_for_dec(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
        return name == "dec"

    module = fsp.shard_module(
        TiedAutoencoder(0), mesh=fsp.make_mesh(device_type="cpu"), blocks=own_group_for_dec
    )
    # fully_shard has already split the tie into two DTensors: the state sees two tensors.
    state = make_state(module)
    assert "dec.weight" in state.role("ae").params
    try:
        make_step()(state, batch_at(0, rank), parallelism=fsp.Layout())
    except ValueError as e:
        return str(e)
    return "not refused"


@pytest.mark.multirank
def test_a_tie_across_fsdp2_groups_is_refused_by_fully_shard_before_any_update(ranks):
    # fvstep relies on this refusal (docs/troubleshooting.md quotes it): FSDP2 checks, at
    # its lazy init in the first forward, that no parameter is managed by two groups.
    for message in ranks.run(check_tie_across_fsdp2_groups_is_refused):
        assert "shared with a parameter already managed by another FSDP group" in message
