"""How activation offloading moves tensors: pinned host memory, two side streams a device.

:mod:`fvstep.parallel.activation_offload` decides what moves and when; this moves it.
Each device gets a host-bound and a device-bound copy stream. A copy out waits for the
compute stream, records an event when done, and keeps the device memory from reuse until
it has been read (``record_stream``); a copy back waits for that event, and the compute
stream waits for its arrival. State: the side streams, per device, for the life of the
prepared module; the copies belong to the autograd graph that saved them.

Examples:
    >>> copies = CudaCopies()
    >>> host, done = copies.out(t)
    >>> t2 = copies.ready(*copies.back(host, t.device, done))
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CudaCopies"]


class CudaCopies:
    """How tensors go to pinned host memory and back: on two side streams per device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def _pair(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The device's (host-bound, device-bound) copy streams."""
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def movable(self, t: torch.Tensor, min_bytes: int) -> bool:
        """Whether ``t`` is worth moving: a plain contiguous CUDA tensor of ``min_bytes``
        or more (a parameter, a subclass, a view with gaps or a CPU tensor stays)."""
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
