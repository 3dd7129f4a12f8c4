"""GEMM bias gradients (``prepare(gemm_bias_grads=True)``): the forward and the input and
weight gradients are the plain layer's, bit for bit; the bias gradient is the same sum
in another order; nothing is renamed.

The laws are checked against plain ``nn.Linear`` in eager fp32 and under CPU bf16
autocast, with hypothesis choosing the shapes; then a prepared tiny Wan against the
plain one (eager, checkpointed, compiled), a LoRA student over a base given the
forward, and checkpoint keys. The speed it buys is measured on the H200
(``docs/benchmarks.md``), not here.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn

import fvstep as fs
from fvstep import tree
from fvstep.methods import finetune
from fvstep.models import synthetic_batch, tiny_wan
from fvstep.parallel.bias_grads import apply_gemm_bias_grads, gemm_bias_linear, has_gemm_bias_grads
from fvstep.parallel.block_compile import compile_counts
from fvstep.parallel.prepare import block_names, preparation, prepare

CPU_COMPILE = {"backend": "aot_eager"}


def _grads(layer: nn.Linear, x: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, ...]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    # a loss whose gradient differs per element (a sum's would be all ones)
    (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    assert layer.bias is not None and layer.bias.grad is not None and layer.weight.grad is not None
    assert x.grad is not None
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@settings(max_examples=20, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    fan_in=st.integers(1, 24),
    fan_out=st.integers(1, 24),
    autocast=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_forward_and_the_input_and_weight_gradients_are_bitwise_the_plain_layers(
    lead, fan_in, fan_out, autocast, seed
):
    torch.manual_seed(seed)
    plain = nn.Linear(fan_in, fan_out)
    changed = nn.Linear(fan_in, fan_out)
    changed.load_state_dict(plain.state_dict())
    assert apply_gemm_bias_grads({"layer": changed}) == ("layer",)
    x = torch.randn(*lead, fan_in)
    y0, gx0, gw0, gb0 = _grads(plain, x, autocast)
    y1, gx1, gw1, gb1 = _grads(changed, x, autocast)
    assert y1.dtype == y0.dtype and torch.equal(y1, y0)
    assert torch.equal(gx1, gx0) and torch.equal(gw1, gw0)
    assert gb1.dtype == gb0.dtype == torch.float32
    # the same column sum in another order: bf16 rounding of the sum (autocast), else fp32's
    tol = 1e-2 if autocast else 1e-5
    torch.testing.assert_close(gb1, gb0, rtol=tol, atol=tol * float(gb0.abs().max() + 1))


def test_only_plain_linear_layers_with_a_bias_are_changed_once():
    class Custom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    block = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4, bias=False), Custom(4, 2))
    assert apply_gemm_bias_grads({"b": block}) == ("b.0",)
    assert [has_gemm_bias_grads(m) for m in block] == [True, False, False]
    assert apply_gemm_bias_grads({"b": block}) == ()  # given already: left alone


def test_no_gradient_is_computed_for_what_does_not_need_one():
    layer = nn.Linear(4, 3)
    apply_gemm_bias_grads({"layer": layer})
    layer.requires_grad_(False)
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, 4))
    with torch.no_grad():
        assert torch.equal(gemm_bias_linear(x, layer.weight, layer.bias), layer(x))


def _state(module: nn.Module) -> fs.TrainState:
    return fs.TrainState.create(
        {"student": fs.Role(module, optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.1))},
        key=fs.random.key(0),
    )


def _train(state: fs.TrainState, num_steps: int) -> tuple[fs.TrainState, list[float]]:
    step = fs.compile(finetune(), clip=fs.clip_grad_norm(1.0))
    losses = []
    for i in range(num_steps):
        state, metrics = step(state, synthetic_batch(fs.random.key(i), batch_size=2))
        losses.append(float(metrics["student/loss"]))
    return state, losses


@pytest.mark.parametrize(
    "options",
    [{}, {"checkpointing": "narrow"}, {"compile": CPU_COMPILE}],
    ids=["eager", "narrow", "compiled"],
)
def test_a_prepared_tiny_wan_trains_as_the_plain_one_with_the_same_names(options):
    plain, plain_losses = _train(_state(tiny_wan(seed=0, num_layers=2)), 3)
    before = compile_counts()
    module = prepare(tiny_wan(seed=0, num_layers=2), gemm_bias_grads=True, **options)
    record = preparation(module)
    assert record is not None and record.describe()["gemm_bias_layers"] == len(
        record.gemm_bias_layers
    )
    linears = [
        f"{b}.{n}"
        for b in block_names(module)
        for n, m in module.get_submodule(b).named_modules()
        if isinstance(m, nn.Linear) and m.bias is not None
    ]
    assert list(record.gemm_bias_layers) == linears and linears
    assert [n for n, _ in module.named_parameters()] == [
        n for n, _ in tiny_wan(seed=0, num_layers=2).named_parameters()
    ]
    trained, losses = _train(_state(module), 3)
    if "compile" in options:
        assert compile_counts()["graph_breaks"] == before["graph_breaks"]
    # The first loss is the same forward: bitwise. After that the bias gradients' order
    # moves the parameters in the last bits, through AdamW's normalisation.
    assert losses[0] == plain_losses[0] or "compile" in options
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-4, atol=0)
    tree.assert_trees_close(
        trained.roles["student"].params, plain.roles["student"].params, rtol=0, atol=1e-4
    )
    assert set(tree.flatten_with_paths(trained)[0]) == set(tree.flatten_with_paths(plain)[0])


def test_compiled_under_bf16_autocast_a_block_computes_as_the_plain_compiled_one():
    """Under dynamo a backward that entered an autocast context left autocast off for the
    rest of the block's trace (its other projections ran in fp32)."""

    def grads(gemm: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module = prepare(
            tiny_wan(seed=0, num_layers=2), gemm_bias_grads=gemm, compile={"backend": "aot_eager"}
        )
        batch = synthetic_batch(fs.random.key(0), batch_size=2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(
                hidden_states=batch["latents"],
                timestep=torch.tensor([500.0, 100.0]),
                encoder_hidden_states=batch["text"],
                return_dict=False,
            )[0]
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        return out.detach(), [p.grad for p in module.parameters()]

    (y0, g0), (y1, g1) = grads(False), grads(True)
    assert torch.equal(y1, y0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max() + 1e-6))


def test_a_lora_student_over_a_changed_base_gets_the_plain_adapter_gradients():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_v"], init_lora_weights=False
    )

    def adapter_grads(gemm: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = peft.get_peft_model(tiny_wan(seed=0, num_layers=2), config)
        if gemm:
            assert apply_gemm_bias_grads({"model": model})
        batch = synthetic_batch(fs.random.key(0), batch_size=2)
        out = model(
            hidden_states=batch["latents"],
            timestep=torch.tensor([500.0, 100.0]),
            encoder_hidden_states=batch["text"],
            return_dict=False,
        )[0]
        out.square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, changed = adapter_grads(False), adapter_grads(True)
    assert plain.keys() == changed.keys() and plain
    for name in plain:  # the adapters have no bias: their gradients flow through gx only
        assert torch.equal(changed[name], plain[name]), name


def test_a_bad_gemm_bias_grads_value_is_refused():
    with pytest.raises(TypeError, match="gemm_bias_grads must be a bool"):
        prepare(tiny_wan(seed=0, num_layers=1), gemm_bias_grads="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no blocks"):
        prepare(nn.Linear(2, 2), gemm_bias_grads=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "inductor"])
def test_on_cuda_under_bf16_autocast_the_layers_match_the_plain_ones(compile):
    """cuBLAS's matrix-vector product for the bias; the rest bitwise (eager) or within
    Inductor's own reordering (compiled, against the plain layer compiled alike)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 1024), nn.GELU("tanh"), nn.Linear(1024, 256)).cuda()
    changed = nn.Sequential(nn.Linear(256, 1024), nn.GELU("tanh"), nn.Linear(1024, 256)).cuda()
    changed.load_state_dict(plain.state_dict())
    assert len(apply_gemm_bias_grads({"m": changed})) == 2
    x = torch.randn(2, 4096, 256, device="cuda")

    def grads(m: nn.Module) -> list[torch.Tensor]:
        run = torch.compile(m, fullgraph=True) if compile else m
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = run(x)
        (y.float() * torch.linspace(-1, 1, y.numel(), device="cuda").view(y.shape)).sum().backward()
        return [y.detach()] + [p.grad for p in m.parameters()]

    y0, w0, b0, w1, b1 = grads(plain)
    z0, v0, c0, v1, c1 = grads(changed)
    if compile:
        torch.testing.assert_close(z0, y0, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v0, w0, rtol=2e-2, atol=2e-2 * float(w0.abs().max()))
    else:
        assert torch.equal(z0, y0) and torch.equal(v0, w0) and torch.equal(v1, w1)
    for got, want in ((c0, b0), (c1, b1)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
