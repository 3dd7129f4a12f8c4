"""Activation offloading per block: saved activations wait in pinned host memory.

What a chosen block saves for backward is copied to the host on a side stream and comes
back when the backward of the block after it starts; the hooks check version counters
as autograd would. Details and costs: ``docs/concepts/prepare.md`` (Activation offloading).
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

__all__ = [
    "ActivationOffloading",
    "CudaCopies",
    "apply_activation_offloading",
    "is_offloaded",
    "offloaded_bytes",
    "resolve_offloading",
]

_OFFLOADED_ATTR = "_fvstep_activation_offload"


@attrs.frozen
class ActivationOffloading:
    """Which blocks keep their saved activations in pinned host memory until backward.

    Attributes:
        every: Offload blocks ``0, every, 2 * every, ...`` (counted as for checkpointing).
        min_bytes: Saved tensors smaller than this stay on the device.

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
    """What ``prepare(..., offload_activations=value)`` means (``True``: every block)."""
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


class CudaCopies:
    """Copies to pinned host memory and back on two side streams per device.

    Each copy waits for what it reads; device memory is not reused before it is read."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def _pair(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The device's (host-bound, device-bound) copy streams."""
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def movable(self, t: torch.Tensor, min_bytes: int) -> bool:
        """Whether ``t`` is a plain contiguous CUDA tensor of ``min_bytes`` or more."""
        return (
            type(t) is torch.Tensor  # not a Parameter, DTensor or other subclass
            and t.device.type == "cuda"
            and t.is_contiguous()
            and t.numel() * t.element_size() >= min_bytes
        )

    def out(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``t`` to the host: the copy and the event that says it is done."""
        d2h, _ = self._pair(t.device)
        d2h.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(d2h):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(d2h)
        t.record_stream(d2h)  # its memory is not reused before the copy has read it
        return host, done

    def back(self, host: torch.Tensor, device: torch.device, done: Any) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` back to ``device`` once its copy out is ``done``."""
        _, h2d = self._pair(device)
        h2d.wait_event(done)
        with torch.cuda.stream(h2d):
            back = torch.empty(host.shape, dtype=host.dtype, device=device)
            back.copy_(host, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(h2d)
        return back, arrived

    def ready(self, back: torch.Tensor, arrived: Any) -> torch.Tensor:
        """``back``, usable on the current stream (which waits for it to arrive)."""
        stream = torch.cuda.current_stream(back.device)
        stream.wait_event(arrived)
        back.record_stream(stream)  # not reused before the backward has read it
        return back


class _Kept:
    """A saved tensor left in place, with its version (autograd checks none under the hooks)."""

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


class _Call:
    """One grad-enabled call of a hooked block: what it moved to the host, and how it comes back."""

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

    def pack(self, t: torch.Tensor) -> _Kept | int:
        copies = self.offloader.copies
        if not self.offloads or not copies.movable(t, self.offloader.min_bytes):
            return _Kept(t)
        index, version = self.ids.get(id(t), (-1, -1))
        if index >= 0 and version == tensor_version(t):
            self.uses[index] += 1  # the same tensor saved again: one copy, out and back
            return index
        host, done = copies.out(t)
        self.host.append((host, t.device, done))
        index = len(self.host) - 1
        self.pending.append((index, t, tensor_version(t)))
        self.ids[id(t)] = (index, tensor_version(t))
        self.uses[index] = 1
        self.offloader.moved_bytes += t.numel() * t.element_size()
        return index  # a moved tensor is packed as its index in ``host``

    def end_forward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """The forward returned: check what it changed in place, watch the rest through weakrefs.

        An output with the same memory and version as a saved tensor is watched too: a
        compiled function may save another object sharing the version counter of one it returns.
        """
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

    def unpack(self, packed: _Kept | int) -> torch.Tensor:
        if not self.started:
            self.started = True
            target = self.prefetch() if self.prefetch is not None else None
            # (a target whose backward ran already belongs to a graph kept for another)
            if target is not None and not target.started and self.seq - target.seq <= _LOOKAHEAD:
                target.fetch()
        if isinstance(packed, _Kept):
            return packed.get()
        index = packed
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
    """One prepared module's offloading: the copies, the order of the calls, the bytes moved."""

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
        leaves = optree.tree_leaves(output) if call.pending else ()  # only if something moved
        call.end_forward([t for t in leaves if isinstance(t, torch.Tensor)])


def _install(block: nn.Module, offloader: _Offloader, offloads: bool) -> None:
    contexts: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        _enter(contexts, offloader, offloads)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        _leave(contexts, output)

    # The hooks' frames are skipped by dynamo, so they run around a compiled block's graph
    # and see what it saves. What they call is disabled recursively: a compiled
    # ``end_forward`` would read the tensors' versions as constants of its trace.
    block.register_forward_pre_hook(torch.compiler.disable(enter, recursive=False))
    block.register_forward_hook(torch.compiler.disable(leave, recursive=False), always_call=True)
    object.__setattr__(block, _OFFLOADED_ATTR, (offloader, offloads))


def is_offloaded(block: nn.Module) -> bool:
    """Whether :func:`apply_activation_offloading` chose ``block``."""
    hooked = block.__dict__.get(_OFFLOADED_ATTR)
    return hooked is not None and hooked[1]


def offloaded_bytes(module: nn.Module) -> int:
    """The bytes of saved activations ``module``'s offloaded blocks moved to the host so far (0 on a CPU)."""
    offloaders = {
        id(hooked[0]): hooked[0]
        for m in module.modules()
        if (hooked := m.__dict__.get(_OFFLOADED_ATTR)) is not None
    }
    return sum(o.moved_bytes for o in offloaders.values())


def apply_activation_offloading(
    blocks: Mapping[str, nn.Module], offload: ActivationOffloading
) -> tuple[str, ...]:
    """Hook ``blocks`` (in forward order) to offload what the ones ``offload`` chooses save.

    Returns the chosen names; raises ``ValueError`` if a block is hooked already."""
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
