"""The axes of the interaction matrix, as small named builders.

A new feature joins the matrix by adding a row here: a :class:`WeightsCase` (how a role's
weights are held), a :class:`Preparation` (how its module is prepared), or an observer
(a way of reading the weights back out). The test modules of this folder cross them.

Every reference value here is computed *independently* of the code under test: the
expected EMA weights are read from the state's leaves by the rule written out in
:func:`expected_weights`, never through ``fvstep.core.weights.select_weights``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

import fvstep as fs
from fvstep import parallel as fsp
from fvstep.methods.finetune import flow_matching_loss
from fvstep.methods.models import predict, synthetic_batch, tiny_wan

NUM_STEPS = 3
"""Steps each case trains: the EMA of ``ema_after`` starts at step 1, so it has moved
twice; the EMA of ``ema_before`` starts at step 100, so it has not started."""

PROBE = synthetic_batch(fs.random.key(77), batch_size=2)
PROBE_T = torch.tensor([999.0, 501.0])


def data(step: int) -> dict[str, torch.Tensor]:
    return synthetic_batch(fs.random.fold_in(fs.random.key(1), step), batch_size=2)


def velocity(module: nn.Module) -> torch.Tensor:
    """The module's velocity on the fixed probe, without gradient."""
    with torch.no_grad():
        x = PROBE["latents"] + 0.5 * torch.ones_like(PROBE["latents"])
        return predict(module, x, PROBE_T, PROBE["text"]).float()


# --- weights ---------------------------------------------------------------------------


@attrs.frozen
class WeightsCase:
    """How a role's weights are held: its EMA (and when it starts), LoRA, ties.

    Attributes:
        name: The row's name.
        ema_start: ``None`` for no EMA, else the EMA's ``start_step``.
        lora: The student is a LoRA adapter over a frozen base (role ``"base"``).
        tied: The student is a tiny Wan whose two blocks share one ``norm2.weight``
            (one leaf under two names, :attr:`fvstep.core.state.RoleState.tied`).
    """

    name: str
    ema_start: int | None = None
    lora: bool = False
    tied: bool = False

    @property
    def started(self) -> bool:
        """Whether the EMA has had an active update after :data:`NUM_STEPS` steps (the
        cases trained by :func:`train`; a test training another number of steps must
        not read it)."""
        return self.ema_start is not None and self.ema_start < NUM_STEPS


WEIGHTS = (
    WeightsCase("live"),
    WeightsCase("ema_before_start", ema_start=100),
    WeightsCase("ema_after_start", ema_start=1),
    WeightsCase("lora_ema_before_start", ema_start=100, lora=True),
    WeightsCase("lora_ema_after_start", ema_start=1, lora=True),
    WeightsCase("tied_ema_before_start", ema_start=100, tied=True),
    WeightsCase("tied_ema_after_start", ema_start=1, tied=True),
)
"""The rows of the weights axis."""


def tie(module: nn.Module) -> nn.Module:
    """Tie the two blocks' ``norm2.weight`` into one tensor (a submodule-free tie)."""
    blocks: Any = module.blocks  # type: ignore[attr-defined]
    blocks[1].norm2.weight = blocks[0].norm2.weight
    return module


# --- preparation -----------------------------------------------------------------------


@attrs.frozen
class Preparation:
    """How the trained role's module is prepared (``fvstep.parallel.prepare`` options)."""

    name: str
    options: dict[str, Any] | None = None  # None: not prepared at all


PREPARATIONS = (
    Preparation("none"),
    Preparation("full", {"checkpointing": "full"}),
    Preparation("selective", {"checkpointing": "selective"}),
    Preparation("attention", {"checkpointing": "attention"}),
    Preparation("narrow", {"checkpointing": "narrow"}),
    Preparation("every_2nd", {"checkpointing": fsp.ActivationCheckpointing("full", every=2)}),
    Preparation("compile", {"compile": {"backend": "aot_eager"}}),
    Preparation("full+compile", {"checkpointing": "full", "compile": {"backend": "aot_eager"}}),
    Preparation("offload+narrow", {"offload_activations": True, "checkpointing": "narrow"}),
)
"""The rows of the preparation axis (on one process; FSDP2 options are in the 2-rank cells)."""


def build_state(
    case: WeightsCase,
    prep: Preparation = PREPARATIONS[0],
    *,
    mesh: Any = None,
    shard: Callable[[nn.Module], nn.Module] | None = None,
) -> fs.TrainState:
    """A state whose role ``"student"`` holds its weights as ``case`` says."""
    ema = None if case.ema_start is None else fs.EMA(0.9, start_step=case.ema_start)
    adamw = fs.optim.adamw(lr=1e-2)
    if case.lora:
        import peft

        from fvstep.methods.lora import add_adapters

        base = tiny_wan(seed=0)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_v", "ffn.net.2"], init_lora_weights=False
        )
        student = add_adapters(base, {"student": config}, seed=3)["student"]
        fsp.prepare(base, mesh=mesh, trainable=False, frozen_dtype=None, **(prep.options or {}))
        if mesh is not None:
            fsp.shard_module(student, mesh=mesh)
        roles = {
            "student": fs.Role(student, optimizer=adamw, ema=ema),
            "base": fs.Role(base, save_frozen=False),
        }
    else:
        module = tiny_wan(seed=0)
        if case.tied:
            tie(module)
        if prep.options is not None or mesh is not None:
            fsp.prepare(module, mesh=mesh, **(prep.options or {}))
        elif shard is not None:
            shard(module)
        roles = {"student": fs.Role(module, optimizer=adamw, ema=ema)}
    return fs.TrainState.create(roles, key=fs.random.key(0))


def train(state: fs.TrainState, num_steps: int = NUM_STEPS) -> fs.TrainState:
    step = fs.compile(fs.update("student", flow_matching_loss()))
    layout = fsp.default_layout(state)  # Layout() on several ranks or for sharded roles
    for i in range(num_steps):
        state, _ = step(state, data(i), parallelism=layout)
    return state


def full(t: torch.Tensor) -> torch.Tensor:
    """A leaf's full value (a DTensor is gathered: a collective) on the CPU."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").clone()


def expected_weights(state: fs.TrainState, case: WeightsCase, weights: str) -> dict:
    """The role's parameters as ``weights`` means them, read from the leaves directly.

    The rule, written out: ``"ema"`` is the moving average where the EMA has had an
    active update (``case.started``), the live value everywhere else.
    """
    rs = state.role("student")
    out = {n: full(p) for n, p in rs.params.items()}
    if weights == "ema" and case.started:
        assert rs.ema is not None
        out.update({n: full(p) for n, p in rs.ema.params.items()})
    return out


def reference_module(state: fs.TrainState, case: WeightsCase, weights: str) -> nn.Module:
    """A fresh, unprepared model computing with the expected weights of ``weights``.

    For LoRA: the plain base with ``W + s·B@A`` merged by hand in fp32 (peft's scaling).
    """
    expected = expected_weights(state, case, weights)
    if not case.lora:
        module = tiny_wan(seed=5)
        if case.tied:
            tie(module)
        # tied aliases are not leaves: strict=False, then check every leaf was written
        missing, unexpected = module.load_state_dict(expected, strict=False)
        assert not unexpected and all(".norm2." in m for m in missing), (missing, unexpected)
        return module
    base = {n: full(p) for n, p in state.role("base").params.items()}
    scaling = 8 / 4
    plain: dict[str, torch.Tensor] = {}
    for name, w in base.items():
        if ".base_layer." in name:
            path = name.removesuffix(".base_layer.weight")
            if name.endswith(".weight") and f"{path}.lora_A.weight" in expected:
                a, b = expected[f"{path}.lora_A.weight"], expected[f"{path}.lora_B.weight"]
                w = w.float() + scaling * (b.float() @ a.float())
        plain[name.replace(".base_layer.", ".")] = w
    module = tiny_wan(seed=5)
    module.load_state_dict(plain)
    return module
