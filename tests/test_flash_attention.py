"""FlashAttention-4 behind the flash SDPA backend (``fvstep.parallel.flash_attention``).

On a CPU: what enabling refuses (no package, no CUDA, a GPU FA4 has no kernels for) and
the arity the module hands PyTorch's glue, checked against a stand-in for FA4's
interface module. On a Hopper GPU with ``flash-attn-4`` installed (the GPU machine,
results in ``docs/gpu.md``): SDPA on the flash backend runs FA4, eager and compiled, and
agrees with cuDNN's kernel; a prepared Wan's gradients do too; disabling gives PyTorch's
kernel back.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from fvstep.core._optional import MissingExtraError
from fvstep.methods.models import tiny_wan
from fvstep.parallel import (
    disable_flash_attention_4,
    enable_flash_attention_4,
    flash_attention_4_enabled,
    prepare,
)
from fvstep.parallel import flash_attention as fa4

INTERFACE = "flash_attn.cute.interface"


def _has_fa4_gpu() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        return False
    try:
        return importlib.util.find_spec(INTERFACE) is not None
    except ModuleNotFoundError:
        return False


FA4_GPU = _has_fa4_gpu()


class _StandIn(types.ModuleType):
    """FA4's interface module as the glue sees it: the two kernels, with FA4's arity."""

    def __init__(self) -> None:
        super().__init__(INTERFACE)
        self.calls: list[tuple[str, dict]] = []

    def _flash_attn_fwd(self, q, k, v, **kwargs):
        self.calls.append(("fwd", kwargs))
        return q + 1, q.sum(-1), None, None, None  # out, lse, then three more

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, **kwargs):
        self.calls.append(("bwd", kwargs))
        return q * 2, k * 2, v * 2, torch.zeros(1)  # dq, dk, dv, dsink


@pytest.fixture
def stand_in(monkeypatch):
    module = _StandIn()
    monkeypatch.setitem(sys.modules, INTERFACE, module)
    return module


def test_without_the_package_enabling_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, INTERFACE, None)  # an import of it fails
    with pytest.raises(MissingExtraError, match=r"fvstep\[flash4\]"):
        enable_flash_attention_4()
    assert not flash_attention_4_enabled()


def test_without_cuda_enabling_is_refused(stand_in, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        enable_flash_attention_4()
    assert not flash_attention_4_enabled()


@pytest.mark.parametrize("capability", [(8, 0), (12, 0)], ids=["ampere", "consumer-blackwell"])
def test_on_a_gpu_without_fa4_kernels_enabling_is_refused(stand_in, monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    with pytest.raises(RuntimeError, match=rf"not {capability[0]}\.{capability[1]}"):
        enable_flash_attention_4()
    assert not flash_attention_4_enabled()


def test_the_kernels_reach_pytorchs_glue_with_the_arity_it_unpacks(stand_in):
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    out, lse = fa4._flash_attn_fwd(q, k, v, softmax_scale=0.5, return_lse=True)
    assert torch.equal(out, q + 1) and torch.equal(lse, q.sum(-1))
    dq, dk, dv = fa4._flash_attn_bwd(q, k, v, out, out, lse, causal=False)
    assert torch.equal(dq, q * 2) and torch.equal(dk, k * 2) and torch.equal(dv, v * 2)
    assert stand_in.calls == [
        ("fwd", {"softmax_scale": 0.5, "return_lse": True}),
        ("bwd", {"causal": False}),
    ]
    # PyTorch's glue imports the kernels from this module's path, checking for both names
    from torch.nn.attention import _fa4

    assert _fa4._fa4_import_module.__wrapped__(fa4.__name__) is fa4


def test_size_one_dimensions_lose_zero_strides_and_keep_their_memory(stand_in):
    seen = {}

    def forward(q, k, v, **kwargs):
        seen.update(q=q, out=kwargs["out"])
        kwargs["out"].fill_(7.0)
        return kwargs["out"], q.sum(-1), None, None, None

    stand_in._flash_attn_fwd = forward
    base = torch.zeros(1, 5, 2, 8)
    query = base.as_strided(base.shape, (0, 16, 8, 1))  # as Inductor may give a batch of 1
    buffer = torch.zeros(1, 5, 2, 8)
    out = buffer.as_strided(buffer.shape, (0, 16, 8, 1))
    fa4._flash_attn_fwd(query, query, query, out=out)
    assert 0 not in seen["out"].stride() and 0 not in seen["q"].stride()
    assert seen["out"].data_ptr() == buffer.data_ptr() and seen["q"].data_ptr() == base.data_ptr()
    assert torch.equal(buffer, torch.full_like(buffer, 7.0))  # written where the glue reads
    plain = torch.zeros(2, 3)
    assert fa4._unbroadcast(plain) is plain
    wide = torch.zeros(3, 1).expand(3, 4)  # a real broadcast (size 4, stride 0) stays
    assert fa4._unbroadcast(wide).stride() == wide.stride()


def test_disabling_when_not_enabled_changes_nothing():
    disable_flash_attention_4()
    assert not flash_attention_4_enabled()


# --- on a Hopper/Blackwell GPU with flash-attn-4 ---------------------------------------

_skip = pytest.mark.skipif(not FA4_GPU, reason="needs flash-attn-4 and a 9.x/10.x GPU")
# CuTe DSL warns at each kernel's first compile that it cannot type FA4's aux_data argument
_quiet = pytest.mark.filterwarnings("ignore:Argument aux_data:UserWarning")


def needs_fa4(test):
    return _skip(_quiet(test))


@pytest.fixture
def counted(monkeypatch):
    """FA4 enabled for the test; counts the forwards that reach its kernels."""
    calls = []
    kernel = fa4._flash_attn_fwd

    def forward(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fa4, "_flash_attn_fwd", forward)
    enable_flash_attention_4()
    yield calls
    disable_flash_attention_4()


def _randn(*shape, count=3, seed=0):
    """``count`` bf16 CUDA tensors of ``shape``, the same for a seed."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(count)
    ]


def _attention(backend):
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return attend


@needs_fa4
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("keys", [1000, 77], ids=["self", "cross"])
def test_the_flash_backend_runs_fa4_and_agrees_with_cudnn(counted, compiled, keys):
    from torch.nn.attention import SDPBackend

    (q,) = _randn(2, 4, 1000, 128, count=1)
    k, v = _randn(2, 4, keys, 128, count=2, seed=1)
    dout = torch.randn_like(q)

    def run(attend):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs)
        return [out, *torch.autograd.grad(out, inputs, dout)]

    flash = _attention(SDPBackend.FLASH_ATTENTION)
    got = run(torch.compile(flash, fullgraph=True) if compiled else flash)
    assert counted, "the flash backend did not reach FA4's kernels"
    want = run(_attention(SDPBackend.CUDNN_ATTENTION))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    disable_flash_attention_4()
    before = len(counted)
    run(flash)
    assert len(counted) == before, "after disabling, the flash backend still ran FA4"


@needs_fa4
def test_inputs_with_zero_strides_on_size_one_dimensions_run_on_fa4(counted):
    from torch.nn.attention import SDPBackend

    q, k, v = _randn(1, 4, 600, 128)
    zero = [t.as_strided(t.shape, (0, *t.stride()[1:])) for t in (q, k, v)]
    got = _attention(SDPBackend.FLASH_ATTENTION)(*zero)
    assert counted
    want = _attention(SDPBackend.CUDNN_ATTENTION)(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_fa4
def test_under_deterministic_algorithms_fa4s_backward_repeats_bitwise(counted):
    from torch.nn.attention import SDPBackend

    q, k, v = _randn(1, 4, 4096, 128)
    dout = torch.randn_like(q)
    flash = _attention(SDPBackend.FLASH_ATTENTION)

    def grads():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(flash(*inputs), inputs, dout)

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(was)
    assert counted
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@needs_fa4
def test_a_prepared_wan_on_fa4_has_the_loss_and_gradients_of_cudnn(counted):
    def gradients(backend):
        module = tiny_wan(seed=0, num_layers=2, dim_per_head=128, num_heads=2).cuda()
        module = prepare(module, attention_backend=backend, compile=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, 4, 3, 16, 16, device="cuda", generator=g)
        text = torch.randn(1, 7, 16, device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = module(
                hidden_states=x,
                timestep=torch.tensor([500.0], device="cuda"),
                encoder_hidden_states=text,
                return_dict=False,
            )[0]
        loss = out.float().square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in module.named_parameters()}

    loss4, grads4 = gradients("_native_flash")
    assert counted
    loss, grads = gradients("_native_cudnn")
    torch.testing.assert_close(loss4, loss, rtol=1e-2, atol=0)
    for name, grad in grads.items():
        scale = grad.abs().max().item() + 1e-12
        err = (grads4[name] - grad).abs().max().item()
        assert err <= 5e-2 * scale, f"{name}: {err} against {scale}"
