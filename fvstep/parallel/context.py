"""Context (sequence) parallelism: one sample's tokens sharded over a mesh axis.

:func:`apply_context_parallel` prepares a diffusers transformer with diffusers' own
machinery, and adds what training needs: inputs checked to agree over a context group and
FSDP2 made to sum the group's partial gradients. ``docs/concepts/context-parallel.md``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fvstep.core._optional import needs_extra
from fvstep.core.tree import is_dtensor
from fvstep.parallel.mesh import check_axis
from fvstep.parallel.ranks import rank_and_world

__all__ = [
    "ContextParallelMode",
    "applied_context_group",
    "apply_context_parallel",
    "context_parallel_degree",
]

ContextParallelMode = Literal["ulysses", "ring"]
"""``"ulysses"``: all-to-all of heads and tokens around attention (DeepSpeed-Ulysses);
``"ring"``: key/value chunks passed around the group, softmax merged chunk by chunk."""

_MODES: tuple[str, ...] = ("ulysses", "ring")
_APPLIED = "_fvstep_context_parallel"  # attribute of a prepared module (not a parameter)


@attrs.frozen
class _Applied:
    """What :func:`apply_context_parallel` did to a module (kept on the module)."""

    mesh: DeviceMesh
    axis: str
    mode: str
    degree: int
    group_ranks: tuple[int, ...]
    check_inputs: bool


def context_parallel_degree(module: nn.Module) -> int:
    """Ranks per context group of a module prepared by :func:`apply_context_parallel`, else 1."""
    applied = getattr(module, _APPLIED, None)
    return applied.degree if isinstance(applied, _Applied) else 1


def _shard(value: Any, spec: Any, mesh: DeviceMesh) -> Any:
    """``value``'s slice along the spec's dim for this rank (diffusers' sharder)."""
    with needs_extra("models", "context parallelism"):
        from diffusers.hooks.context_parallel import EquipartitionSharder

    if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        return type(value)(_shard(v, s, mesh) for v, s in zip(value, spec, strict=True))
    if not isinstance(value, torch.Tensor):
        return value
    if spec.expected_dims is not None and value.dim() != spec.expected_dims:
        return value  # the plan's rule (Wan2.1's (B,) timestep: Wan2.2's (B, S) is split)
    return EquipartitionSharder.shard(value, spec.split_dim, mesh)


def _output_hook(specs: Mapping[int, Any], fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """A forward hook applying ``fn(item, spec)`` to each output item (or the tensor) with a spec."""

    def hook(m: nn.Module, args: Any, output: Any) -> Any:
        items = [output] if isinstance(output, torch.Tensor) else list(output)
        for index, spec in specs.items():
            if spec is not None:
                items[index] = fn(items[index], spec)
        return items[0] if isinstance(output, torch.Tensor) else type(output)(items)

    return hook


def _install_plan(
    module: nn.Module, plan: dict[str, Any], splits: dict[str, Any], mesh: DeviceMesh
) -> None:
    """diffusers' context-parallel plan (and its :func:`_split_plan`) as ``nn.Module`` hooks.

    diffusers replaces each planned submodule's ``forward``, which activation
    checkpointing's re-bound ``forward`` would silently drop; hooks run in ``__call__``
    whatever ``forward`` is, so the plan survives any order of preparation.
    """
    with needs_extra("models", "context parallelism"):
        from diffusers.hooks.context_parallel import EquipartitionSharder
        from diffusers.models._modeling_parallel import ContextParallelOutput

    def split(x: Any, spec: Any) -> Any:
        return _shard(x, spec, mesh)

    def gather(x: torch.Tensor, spec: Any) -> torch.Tensor:
        return EquipartitionSharder.unshard(x.contiguous(), spec.gather_dim, mesh)

    for name, entry in plan.items():
        sub = module.get_submodule(name) if name else module
        if isinstance(entry, dict):
            params, inputs, outputs = splits[name]

            def split_inputs(
                m: nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                inputs: dict[Any, Any] = inputs,
                params: list[str] = params,
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
                listed = list(args)
                for key, spec in inputs.items():
                    if key in kwargs:
                        kwargs[key] = split(kwargs[key], spec)
                    elif params.index(key) < len(listed):
                        index = params.index(key)
                        listed[index] = split(listed[index], spec)
                return tuple(listed), kwargs

            if inputs:
                sub.register_forward_pre_hook(split_inputs, with_kwargs=True)
            if outputs:
                sub.register_forward_hook(_output_hook(outputs, split))
        else:
            specs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
            sub.register_forward_hook(_output_hook(dict(enumerate(specs)), gather))


def _diffusers_mesh(mesh: DeviceMesh, dim: int, mode: str) -> DeviceMesh:
    """``mesh`` reshaped to ``(replicas, ring, ulysses)``, the axes diffusers reads."""
    degree = mesh.mesh.shape[dim]
    ranks = mesh.mesh.movedim(dim, -1).reshape(-1, degree)
    shape = (-1, degree, 1) if mode == "ring" else (-1, 1, degree)
    return DeviceMesh(
        mesh.device_type,
        ranks.reshape(shape),
        mesh_dim_names=("fvstep_replica", "ring", "ulysses"),
    )


def _fingerprint(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Seven float64 numbers that differ, in practice, between different inputs."""
    out = torch.zeros(7, dtype=torch.float64, device=device)
    out[0] = len(values)
    for j, x in enumerate(values):  # no host sync: the numbers stay on ``device``
        flat = x.detach().reshape(-1).to(device=device, dtype=torch.float64)
        ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=device)
        sums = torch.stack([flat.sum(), flat.square().sum(), (flat * ramp).sum()])
        shape = torch.tensor(
            [x.dim(), flat.numel(), sum(x.shape)], dtype=torch.float64, device=device
        )
        out[1:] += (j + 1) * torch.cat([shape, sums])
    return out


def _check_same_inputs(
    applied: _Applied, tensors: list[torch.Tensor], device: torch.device
) -> None:
    group = applied.mesh[applied.axis].get_group()
    mine = _fingerprint(tensors, device)
    rows = [torch.empty_like(mine) for _ in range(applied.degree)]
    dist.all_gather(rows, mine, group=group)
    if not all(torch.equal(rows[0], r) for r in rows[1:]):  # every rank gets the same verdict
        raise ValueError(
            f"the ranks {list(applied.group_ranks)} of one context group were given different inputs: "
            "call the step with parallelism=fvstep.parallel.Layout(mesh). See docs/concepts/context-parallel.md"
        )


def _set_grad_reduction(module: nn.Module, applied: _Applied) -> None:
    """Make FSDP2 sum the context group's partial gradients (it would average them)."""
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp:  # plain modules: the caller sums the gradients (fvstep refuses them)
        return
    fsdp_mesh = next((p.device_mesh for p in module.parameters() if is_dtensor(p)), None)  # type: ignore[attr-defined]
    if fsdp_mesh is None:  # FSDP2 with no parameters to reduce
        return
    reduced = set(fsdp_mesh.mesh.reshape(-1).tolist())
    if not set(applied.group_ranks) <= reduced or len(reduced) % applied.degree:
        raise ValueError(
            f"the FSDP2 mesh of {type(module).__name__} (ranks {sorted(reduced)}) does not span its "
            f"context group (ranks {list(applied.group_ranks)}): shard over every rank (make_mesh())"
        )
    replicas = float(len(reduced) // applied.degree)
    for m in fsdp:
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(replicas)


def _num_tokens(module: nn.Module, hidden_states: torch.Tensor) -> int | None:
    """Tokens of ``(B, C, F, H, W)`` latents after patching; ``None`` for other shapes."""
    patch = tuple(getattr(getattr(module, "config", None), "patch_size", None) or ())
    if not patch or hidden_states.dim() != 2 + len(patch):
        return None
    return math.prod(size // p for size, p in zip(hidden_states.shape[2:], patch))


def _pre_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    applied: _Applied = getattr(module, _APPLIED)
    x = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(x, torch.Tensor):
        raise ValueError("a context-parallel module takes hidden_states as a tensor")
    if applied.check_inputs:  # first: every rank of the group then sees the same shapes
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        _check_same_inputs(applied, tensors, x.device)
    tokens = _num_tokens(module, x)
    if tokens is not None and tokens % applied.degree:
        raise ValueError(
            f"the sequence of {tokens} tokens (latents {tuple(x.shape)}, patch {tuple(getattr(module.config, 'patch_size', ()))}) "
            f"does not divide by the context-parallel degree {applied.degree}: choose frames/height/width that do"
        )
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        _set_grad_reduction(module, applied)


def _processors(module: nn.Module) -> list[Any]:
    """diffusers' attention processors in ``module`` that take a parallel config."""
    processors = (getattr(sub, "processor", None) for sub in module.modules())
    return [p for p in processors if hasattr(p, "_parallel_config")]


def _check_backends(module: nn.Module, mode: str) -> None:
    """Refuse attention backends of ``module`` that diffusers cannot run context parallel (``mode``)."""
    with needs_extra("models", "context parallelism"):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backends = set()
    for processor in _processors(module):
        backend = getattr(processor, "_attention_backend", None)
        if backend is None:
            backend, _ = _AttentionBackendRegistry.get_active_backend()
        backends.add(str(getattr(backend, "value", backend)))
    unsupported = sorted(
        b for b in backends if b not in _AttentionBackendRegistry._supports_context_parallel
    )
    if unsupported:
        raise ValueError(
            f"the attention backend(s) {unsupported} of {type(module).__name__} do not support context "
            f"parallelism: call module.set_attention_backend(...) with one of {sorted(_AttentionBackendRegistry._supports_context_parallel)}"
        )
    if mode == "ring" and "native" in backends:
        # diffusers' ring attention merges per-chunk outputs with their log-sum-exp, which
        # its native (SDPA) backend does not return: it would fail at the first forward.
        raise ValueError(
            "mode='ring' needs an attention backend that returns the log-sum-exp (CUDA only, not 'native'): "
            "use mode='ulysses', or module.set_attention_backend(...) first. See docs/concepts/context-parallel.md"
        )


def _split_plan(
    module: nn.Module, plan: dict[str, Any]
) -> dict[str, tuple[list[str], dict[Any, Any], dict[Any, Any]]]:
    """Per planned submodule with specs by argument: ``(forward's parameters, inputs, outputs)``.

    Refuses a submodule that no longer takes by name an input the plan splits (a wrapper
    module such as torch's ``checkpoint_wrapper``, or ``torch.compile(module)``).
    """
    with needs_extra("models", "context parallelism"):
        from diffusers.models._modeling_parallel import ContextParallelInput

    splits = {}
    for name, entry in plan.items():
        if not isinstance(entry, dict):
            continue
        sub = module.get_submodule(name) if name else module
        params = list(inspect.signature(type(sub).forward).parameters)[1:]  # self
        inputs = {
            k: v
            for k, v in entry.items()
            if not (isinstance(v, ContextParallelInput) and v.split_output)
        }
        for key in inputs:
            if isinstance(key, str) and key not in params:
                raise ValueError(
                    f"submodule {name or '<root>'!r} ({type(sub).__name__}) takes no argument {key!r} that the plan "
                    "splits: apply context parallel before wrapping blocks in modules (docs/concepts/context-parallel.md)"
                )
        splits[name] = (params, inputs, {k: v for k, v in entry.items() if k not in inputs})
    return splits


def apply_context_parallel(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    axis: str = "context",
    mode: ContextParallelMode = "ulysses",
    check_inputs: bool = True,
) -> nn.Module:
    """Shard ``module``'s token sequence over the ``axis`` of ``mesh``, for training.

    The model's ``_cp_plan`` is installed as ``nn.Module`` hooks; the output is whole on
    every rank of a context group, and parameter names do not change. Call this before
    ``fully_shard`` and before wrapping blocks in modules; call steps with
    ``parallelism=fvstep.parallel.Layout(mesh)`` (``docs/concepts/context-parallel.md``).

    Args:
        module: A ``diffusers.ModelMixin`` with a ``_cp_plan``.
        mesh: A mesh with a context axis (:func:`make_context_mesh`), on every rank.
        mode: ``"ulysses"`` (the heads must divide by the degree) or ``"ring"`` (CUDA only).
        check_inputs: At each forward, check that the ranks of the group were given the
            same inputs (one small all-gather and a host sync).

    Raises:
        ValueError: If the module has no plan, is parallel already or wrapped; if the mesh
            has no ``axis`` of 2 ranks or more; if ``mode`` is unknown, or the heads (Ulysses)
            or the attention backend do not allow it; at a forward, if the tokens do not
            divide by the degree or the ranks of a group were given different inputs.
    """
    with needs_extra("models", "context parallelism"):
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    plan = getattr(module, "_cp_plan", None)
    if not isinstance(plan, dict):
        raise ValueError(
            f"{type(module).__name__} has no context-parallel plan (_cp_plan); diffusers "
            "models such as WanTransformer3DModel have one"
        )
    if getattr(module, "_parallel_config", None) is not None or hasattr(module, _APPLIED):
        raise ValueError(f"{type(module).__name__} is already prepared for parallelism")
    dim = check_axis(mesh, axis)
    degree = mesh.mesh.shape[dim]
    if degree < 2:
        raise ValueError(f"the mesh axis {axis!r} has {degree} rank; context parallel needs >= 2")
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if mode == "ulysses" and heads is not None and heads % degree:
        raise ValueError(
            f"Ulysses context parallel splits the {heads} attention heads over {degree} ranks: "
            f"the heads must divide by the degree; use a degree dividing {heads}, or mode='ring'"
        )
    _check_backends(module, mode)
    splits = _split_plan(module, plan)

    if mode == "ring":
        cp_config = ContextParallelConfig(ring_degree=degree)
    else:
        cp_config = ContextParallelConfig(ulysses_degree=degree)
    config = ParallelConfig(context_parallel_config=cp_config)
    rank, world = rank_and_world()
    device = torch.device(mesh.device_type)
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    # What ModelMixin.enable_parallelism does, less its device lookup
    # (``rank % torch.accelerator.device_count()``), which divides by zero on a CPU, and
    # with the plan installed as nn.Module hooks (see _install_plan).
    config.setup(rank, world, device, mesh=_diffusers_mesh(mesh, dim, mode))
    setattr(module, "_parallel_config", config)  # noqa: B010 (what enable_parallelism sets)
    for processor in _processors(module):
        processor._parallel_config = config
    _install_plan(module, plan, splits, mesh[axis])

    group_ranks = tuple(dist.get_process_group_ranks(mesh[axis].get_group()))
    applied = _Applied(mesh, axis, mode, degree, group_ranks, check_inputs)
    object.__setattr__(module, _APPLIED, applied)  # a plain attribute: no state-dict key
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True, prepend=True)
    return module


def applied_context_group(module: nn.Module) -> tuple[int, ...] | None:
    """The global ranks of ``module``'s context group (:func:`apply_context_parallel`), or ``None``."""
    applied = getattr(module, _APPLIED, None)
    return applied.group_ranks if isinstance(applied, _Applied) else None
