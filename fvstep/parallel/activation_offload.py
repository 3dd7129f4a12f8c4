"""Activation offloading per block: saved activations wait in pinned host memory.

The memory lever that recomputes nothing. A chosen block's forward runs under
``torch.autograd.graph.saved_tensors_hooks``: every tensor it saves for backward (under
``torch.compile``, what the compiled block's autograd function saves) that is a plain,
contiguous CUDA tensor of at least ``min_bytes`` is copied to pinned host memory on a
side stream; its device memory is released once the copy is done and the forward has
returned. The copies come back on a second side stream **one block ahead**: when the
backward of the block after an offloaded one starts. Parameters never move (FSDP2 frees
and re-gathers them), nor tensors off a CUDA device: on a CPU nothing moves.

The copies are exact: a step with offloading is bitwise the step without it. Autograd
checks no version counter under saved-tensor hooks, so the hooks do: a saved tensor
changed in place raises autograd's own error in backward, whether kept on the device,
moved and changed before its block's forward returns (it is held until then), moved and
alive at backward, or changed through the block's output that shares its memory (a
compiled function may save a separate object sharing the memory and version counter of
a tensor it returns; an eager block may return ``z.detach()`` of a saved ``z``). Unseen,
where plain autograd raises: a moved tensor changed after its block returned and then
freed, with every tensor of the same layout over its memory, before backward; or changed
through a view of another shape. The copy then holds the value of the forward. An output
of the same layout with a version counter of its own (``z.data``) is watched all the
same: changing it raises, where plain autograd does not.

What it costs is PCIe bandwidth: each offloaded block's saved tensors cross it twice a
step. Choose ``every`` so that the copy of one block's activations takes less time than
the forward (and the backward) of ``every`` blocks (``docs/benchmarks.md``, an H200).

State: the host copies live as long as the autograd graph that saved them, the side
streams are per device; nothing outlives a step's backward or belongs in ``TrainState``.

Examples:
    >>> offload = ActivationOffloading(every=4)
    >>> apply_activation_offloading({"blocks.0": block, "blocks.1": other}, offload)
    ('blocks.0',)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import optree
import torch
from torch import nn

from fvstep.core._checks import check_int
from fvstep.core._compat import tensor_version
from fvstep.parallel.offload_copies import CudaCopies

__all__ = [
    "ActivationOffloading",
    "apply_activation_offloading",
    "is_offloaded",
    "offloaded_bytes",
    "resolve_offloading",
]

_OFFLOADED_ATTR = "_fvstep_activation_offload"


@attrs.frozen
class ActivationOffloading:
    """Which blocks keep their saved activations in pinned host memory between forward
    and backward.

    Attributes:
        every: Offload every ``every``-th block (blocks ``0, every, 2 * every, ...``),
            counted as :func:`fvstep.parallel.prepare` counts blocks for checkpointing.
        min_bytes: Saved tensors smaller than this stay on the device (the copy's
            latency would cost more than the memory is worth).

    Raises:
        TypeError: If ``every`` or ``min_bytes`` is not an integer.
        ValueError: If it is smaller than 1.

    Examples:
        >>> ActivationOffloading(every=5)   # 6 of a 30-block model's blocks
    """

    every: int = attrs.field(default=1, converter=lambda v: check_int(v, "every", minimum=1))
    min_bytes: int = attrs.field(
        default=1 << 20, converter=lambda v: check_int(v, "min_bytes", minimum=1)
    )

    def chooses(self, index: int) -> bool:
        """Whether the ``index``-th block is offloaded."""
        return index % self.every == 0


def resolve_offloading(value: ActivationOffloading | bool | None) -> ActivationOffloading | None:
    """What ``prepare(..., offload_activations=value)`` means: ``None``/``False`` for
    none, ``True`` for every block, or the :class:`ActivationOffloading` given.

    Raises:
        TypeError: On any other value.

    Examples:
        >>> resolve_offloading(True)
        ActivationOffloading(every=1, min_bytes=1048576)
    """
    if value is None or value is False:
        return None
    if value is True:
        return ActivationOffloading()
    if isinstance(value, ActivationOffloading):
        return value
    raise TypeError(
        "offload_activations must be a bool, None or an ActivationOffloading, not "
        f"{type(value).__name__}"
    )


def _changed_in_place(t: torch.Tensor, now: int, then: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a {tuple(t.shape)} {t.dtype} tensor saved by an "
        f"offloading-hooked block is at version {now}; expected version {then} instead"
    )


class _Kept:
    """A saved tensor that stays where it is, with its version then: autograd checks no
    version under saved-tensor hooks, so this does."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor_version(tensor)

    def get(self) -> torch.Tensor:
        now = tensor_version(self.tensor)
        if now != self.version:
            raise _changed_in_place(self.tensor, now, self.version)
        return self.tensor


def _memory(t: torch.Tensor) -> tuple[Any, ...]:
    """Where and how a tensor lays out its elements: equal for aliases of one memory."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a block's output (a tensor, or a tree of them)."""
    return [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor)]


class _Moved:
    """A saved tensor copied to the host: its index in its call's copies (the call that
    saved it is the one whose ``unpack`` gets it back)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Call:
    """One grad-enabled call of a hooked block: what it moved to the host, and how it
    comes back."""

    __slots__ = (
        "__weakref__",
        "back",
        "changed",
        "host",
        "ids",
        "offloader",
        "offloads",
        "pending",
        "prefetch",
        "seq",
        "started",
        "unpacks",
        "uses",
        "watched",
    )

    def __init__(self, offloader: _Offloader, offloads: bool, seq: int, prefetch: Any) -> None:
        self.offloader = offloader
        self.offloads = offloads
        self.seq = seq
        self.prefetch = prefetch  # weakref to the offloaded call to bring back, or None
        self.started = False  # whether its backward has unpacked anything yet
        self.host: list[tuple[torch.Tensor, torch.device, Any]] = []  # copy, device, event
        self.back: dict[int, tuple[torch.Tensor, Any]] = {}  # copy back, its event
        # Versions, checked as autograd would (it checks none under saved-tensor hooks):
        # a moved tensor is held until its block's forward ends (``end_forward``; its
        # memory is held by its copy until then anyway), then watched through a weakref.
        self.pending: list[tuple[int, torch.Tensor, int]] = []
        # id of a pending tensor -> its latest copy's index and version (saved twice)
        self.ids: dict[int, tuple[int, int]] = {}
        self.uses: dict[int, int] = {}  # index -> how many saved slots hold it
        self.unpacks: dict[int, int] = {}  # index -> how many unpacks of it so far
        self.changed: dict[int, RuntimeError] = {}
        self.watched: dict[int, tuple[list[Any], int]] = {}

    def pack(self, t: torch.Tensor) -> Any:
        copies = self.offloader.copies
        if not self.offloads or not copies.movable(t, self.offloader.min_bytes):
            return _Kept(t)
        index, version = self.ids.get(id(t), (-1, -1))
        if index >= 0 and version == tensor_version(t):
            self.uses[index] += 1  # the same tensor saved again: one copy, out and back
            return _Moved(index)
        host, done = copies.out(t)
        self.host.append((host, t.device, done))
        index = len(self.host) - 1
        self.pending.append((index, t, tensor_version(t)))
        self.ids[id(t)] = (index, tensor_version(t))
        self.uses[index] = 1
        self.offloader.moved_bytes += t.numel() * t.element_size()
        return _Moved(index)

    def end_forward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """The block's forward returned: check what it changed in place since it saved it,
        and watch the rest through weakrefs (the tensors may now be freed).

        A block's output that is the same memory as a saved tensor (same address, dtype,
        shape, strides and version) is watched too: a compiled function may save a
        separate tensor object sharing the memory and version counter of one it returns
        (and an eager block may return ``z.detach()`` of a saved ``z``). The saved object
        is freed here; the caller's output lives on, and a change through it is what
        plain autograd would catch."""
        aliases: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for o in outputs:
            aliases.setdefault(_memory(o), []).append(o)
        for index, t, version in self.pending:
            now = tensor_version(t)
            if now != version:
                self.changed[index] = _changed_in_place(t, now, version)
                continue
            refs = [weakref.ref(t)] + [
                weakref.ref(o)
                for o in aliases.get(_memory(t), ())
                if o is not t and tensor_version(o) == version
            ]
            self.watched[index] = (refs, version)
        self.pending.clear()
        self.ids.clear()

    def check(self, index: int) -> None:
        """Raise autograd's error if the moved tensor ``index`` was changed in place."""
        if self.pending:  # a backward before the forward returned
            self.end_forward()
        if index in self.changed:
            raise self.changed[index]
        refs, version = self.watched[index]
        for ref in refs:
            t = ref()
            if t is not None and tensor_version(t) != version:
                raise _changed_in_place(t, tensor_version(t), version)

    def fetch(self) -> None:
        """Start bringing every moved tensor back (once; a no-op after the first)."""
        for i, (host, device, offloaded) in enumerate(self.host):
            if i not in self.back:
                self.back[i] = self.offloader.copies.back(host, device, offloaded)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not self.started:
            self.started = True
            target = self.prefetch() if self.prefetch is not None else None
            # (a target whose backward ran already belongs to a graph kept for another)
            if target is not None and not target.started and self.seq - target.seq <= _LOOKAHEAD:
                target.fetch()
        if isinstance(packed, _Kept):
            return packed.get()
        index = packed.index
        self.check(index)
        if index not in self.back:
            self.fetch()
        self.unpacks[index] = self.unpacks.get(index, 0) + 1
        # The copy back serves every slot that saved the tensor, then is let go.
        last = self.unpacks[index] % self.uses[index] == 0
        back = self.back.pop(index) if last else self.back[index]
        return self.offloader.copies.ready(*back)


#: How many calls ahead of its backward an offloaded call's tensors start coming back:
#: when the backward of the call right after it starts.
_LOOKAHEAD = 1


class _Offloader:
    """The offloading of one prepared module's chosen blocks: how tensors move
    (``copies``), the order of the calls (to know which to bring back next), and the bytes
    moved so far."""

    def __init__(self, min_bytes: int, copies: Any = None) -> None:
        self.min_bytes = min_bytes
        self.copies = CudaCopies() if copies is None else copies
        self.moved_bytes = 0
        self._seq = itertools.count()
        self._last_offloaded: Any = None  # weakref to the latest offloading call

    def begin(self, offloads: bool) -> _Call:
        call = _Call(self, offloads, next(self._seq), self._last_offloaded)
        if offloads:
            self._last_offloaded = weakref.ref(call)
        return call


@torch.compiler.disable  # recursive: dynamo traces nothing the bookkeeping calls
def _enter(contexts: list[Any], offloader: _Offloader, offloads: bool) -> None:
    if not torch.is_grad_enabled():
        contexts.append(None)
        return
    call = offloader.begin(offloads)
    context = torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack)
    context.__enter__()
    contexts.append((context, call))


@torch.compiler.disable
def _leave(contexts: list[Any], output: Any) -> None:
    if not contexts:  # a pre-hook before ``enter`` raised: ``enter`` never ran
        return
    entered = contexts.pop()
    if entered is not None:
        context, call = entered
        context.__exit__(None, None, None)
        # (the outputs are read only when the call moved something: no flatten otherwise)
        call.end_forward(_output_tensors(output) if call.pending else ())


def _install(block: nn.Module, offloader: _Offloader, offloads: bool) -> None:
    contexts: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        _enter(contexts, offloader, offloads)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        _leave(contexts, output)

    # The hooks' own frames are skipped by dynamo (run as Python around a compiled
    # block's graph, so they see what the compiled autograd function saves, with no graph
    # break). What they call is disabled recursively: a function that a skipped frame
    # calls is compiled by dynamo otherwise, and a compiled ``end_forward`` read the
    # tensors' versions as constants of its trace (a false "modified by an inplace
    # operation" under Inductor).
    block.register_forward_pre_hook(torch.compiler.disable(enter, recursive=False))
    block.register_forward_hook(torch.compiler.disable(leave, recursive=False), always_call=True)
    object.__setattr__(block, _OFFLOADED_ATTR, (offloader, offloads))


def is_offloaded(block: nn.Module) -> bool:
    """Whether :func:`apply_activation_offloading` chose ``block``."""
    hooked = block.__dict__.get(_OFFLOADED_ATTR)
    return hooked is not None and hooked[1]


def offloaded_bytes(module: nn.Module) -> int:
    """The bytes of saved activations that ``module``'s offloaded blocks have moved to
    host memory so far (each crosses back once per backward): 0 on a CPU.

    Examples:
        >>> before = offloaded_bytes(student)
        >>> state, _ = step(state, batch)
        >>> offloaded_bytes(student) - before   # one step's traffic each way
        10737418240
    """
    offloaders = {
        id(hooked[0]): hooked[0]
        for m in module.modules()
        if (hooked := m.__dict__.get(_OFFLOADED_ATTR)) is not None
    }
    return sum(o.moved_bytes for o in offloaders.values())


def apply_activation_offloading(
    blocks: Mapping[str, nn.Module], offload: ActivationOffloading
) -> tuple[str, ...]:
    """Offload the saved activations of the blocks ``offload`` chooses.

    In place: every block gets a forward pre-hook and a forward hook (skipped by dynamo,
    so they work around compiled blocks); the chosen ones move what they save to pinned
    host memory, and the others only say when their backward starts, so that the
    offloaded block before them is brought back in time. Under ``no_grad`` nothing is
    hooked. Parameter names do not change.

    Args:
        blocks: The blocks by qualified name, in the order their forwards run.
        offload: Which blocks, and the smallest tensor worth moving.

    Returns:
        The qualified names of the offloaded blocks, in order.

    Raises:
        ValueError: If a block is hooked already.

    Examples:
        >>> apply_activation_offloading(dict(model.blocks.named_children()),
        ...                             ActivationOffloading(every=2))
        ('0', '2')
    """
    again = [name for name, block in blocks.items() if _OFFLOADED_ATTR in block.__dict__]
    if again:
        raise ValueError(f"activation offloading is applied to {again} already")
    offloader = _Offloader(offload.min_bytes)
    chosen = []
    for i, (name, block) in enumerate(blocks.items()):
        _install(block, offloader, offload.chooses(i))
        if offload.chooses(i):
            chosen.append(name)
    return tuple(chosen)
