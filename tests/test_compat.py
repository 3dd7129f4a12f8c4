"""fvstep.core._compat: each private torch API it wraps resolves, and means what fvstep assumes,
on the installed torch (CI installs the torch pinned in pyproject.toml).

One test per shim; the multi-rank ones run on the 2-rank gloo pool (tests/multirank.py).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from fvstep.core import _compat


def test_fused_kernel_devices_are_the_device_types_torch_checks_fused_against() -> None:
    devices = _compat.fused_kernel_devices()
    assert isinstance(devices, list) and all(isinstance(d, str) for d in devices)
    assert {"cuda", "cpu"} <= set(devices)  # fvstep documents fused AdamW/SGD on both
    # The very list torch.optim.AdamW(fused=True) checks (and names when it refuses).
    p = nn.Parameter(torch.zeros(1, device="meta"))
    p.grad = torch.zeros(1, device="meta")
    with pytest.raises(RuntimeError, match="fused=True") as refused:
        torch.optim.AdamW([p], fused=True).step()
    assert str(devices) in str(refused.value)


@pytest.mark.parametrize("fused", [False, True])
def test_optimizer_step_dtype_is_the_dtype_of_torch_adamws_step(fused: bool) -> None:
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], fused=fused)
    p.grad = torch.ones(3)
    opt.step()
    assert opt.state[p]["step"].dtype == _compat.optimizer_step_dtype(fused=fused)


def test_tensor_version_counts_in_place_changes() -> None:
    t = torch.zeros(3)
    before = _compat.tensor_version(t)
    t.add_(1)
    assert _compat.tensor_version(t) == before + 1
    t.clone()  # not in place
    assert _compat.tensor_version(t) == before + 1


def test_torch_dispatch_mode_sees_every_aten_op() -> None:
    seen: list[str] = []

    class Record(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2) + torch.ones(2)
    assert "aten.add" in seen


def test_checkpoint_wrapper_recomputes_without_changing_values_or_grads() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    inner = copy.deepcopy(plain)
    calls = []
    inner[1].register_forward_hook(lambda *_: calls.append(1))
    wrapped = _compat.checkpoint_wrapper(inner)
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    out = wrapped(x)
    out.sum().backward()
    assert torch.equal(out, plain(x)) and len(calls) == 2  # forward, then recomputed
    twins = dict(wrapped.named_parameters())
    assert len(twins) == len(list(plain.parameters()))
    for name, p in plain.named_parameters():
        twin = next(q for n, q in twins.items() if n.endswith(name))
        assert torch.equal(p.grad, twin.grad), name


def check_fsdp_shims(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = (_compat.is_fsdp_root(model), _compat.is_fsdp_root(model[0]))
    _compat.fsdp_lazy_init(model)  # what the first forward would do, now
    lazily = (_compat.is_fsdp_root(model), _compat.is_fsdp_root(model[0]))
    model(torch.ones(1, 4)).sum().backward()
    after = (_compat.is_fsdp_root(model), _compat.is_fsdp_root(model[0]))

    full = torch.arange(10.0).reshape(5, 2)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    shape, offset = _compat.local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    local = dt.to_local()
    return {
        "before": before,
        "lazily": lazily,
        "after": after,
        "shape_matches": shape == tuple(local.shape),
        "slice_matches": torch.equal(full[offset[0] : offset[0] + shape[0]], local),
        "offset": offset,
    }


@pytest.mark.multirank
def test_fsdp_root_and_dtensor_shard_geometry_on_two_ranks(ranks) -> None:
    results = ranks.run(check_fsdp_shims)
    for result in results:
        assert result["after"] == (True, False), result  # the root, after lazy init
        assert result["lazily"] == (True, False), result  # fsdp_lazy_init did it first
        assert result["before"][1] is False, result
        assert result["shape_matches"] and result["slice_matches"], result
    assert [r["offset"] for r in results] == [(0, 0), (3, 0)]  # 5 rows: 3 + 2


def test_inductor_has_option_finds_the_option_prepare_turns_off():
    from fvstep.core._compat import inductor_has_option

    assert inductor_has_option("triton.mix_order_reduction")
    assert not inductor_has_option("triton.no_such_option_at_all")


def test_dynamo_counters_count_a_compiled_graph():
    import torch

    from fvstep.core._compat import dynamo_counters

    torch._dynamo.reset()
    before = dynamo_counters().get("stats", {}).get("unique_graphs", 0)
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert dynamo_counters()["stats"]["unique_graphs"] == before + 1


def test_inductor_mode_options_name_what_a_mode_turns_on():
    from fvstep.core._compat import inductor_mode_options

    assert inductor_mode_options("max-autotune")["max_autotune"] is True
    assert inductor_mode_options("default") == {}


def test_the_recompile_limit_is_only_ever_raised():
    import torch._dynamo.config as config

    from fvstep.core._compat import raise_recompile_limit

    # config.patch, not monkeypatch: pytest's undo deletes an attribute that was not in
    # the module's __dict__, and a deleted dynamo option is gone for the whole process.
    with config.patch(recompile_limit=8):
        assert raise_recompile_limit(64) == 64 == config.recompile_limit
        assert raise_recompile_limit(16) == 64 == config.recompile_limit
    assert hasattr(config, "recompile_limit")


def test_forward_pre_hooks_lists_the_hooks_registered_on_a_module() -> None:
    module = nn.Linear(2, 2)
    assert _compat.forward_pre_hooks(module) == []

    def hook(mod: nn.Module, args: tuple) -> None:
        return None

    handle = module.register_forward_pre_hook(hook)
    assert _compat.forward_pre_hooks(module) == [hook]
    handle.remove()


def test_fsdp_casts_inputs_is_false_for_a_module_fsdp2_did_not_wrap() -> None:
    # The wrapped cases (with and without a casting MixedPrecisionPolicy) run on two
    # ranks in tests/test_paper_cuts.py::test_bf16_latents_train_a_sharded_fp32_model_on_two_ranks.
    assert _compat.fsdp_casts_inputs(nn.Linear(2, 2)) is False


def test_the_flash_attention_registry_has_what_enabling_fa4_calls() -> None:
    registry = _compat.flash_attention_registry()
    assert callable(registry.register_flash_attention_impl)
    assert callable(registry.activate_flash_attention_impl)
    assert callable(registry.restore_flash_attention_impl)
    assert "FA4" in registry.list_flash_attention_impls()  # torch's own, which fvstep's replaces


def test_register_flash_attention_4_imports_the_kernels_from_the_given_module(monkeypatch) -> None:
    import sys

    from torch.nn.attention import _fa4

    # the glue checks the module it is given for FA4's two kernels before registering
    monkeypatch.setitem(sys.modules, "no_kernels_here", types.ModuleType("no_kernels_here"))
    with pytest.raises(RuntimeError, match="does not expose FA4 kernels"):
        _compat.register_flash_attention_4("no_kernels_here")
    assert _fa4._FA4_MODULE_PATH != "no_kernels_here"
