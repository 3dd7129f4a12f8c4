"""Counter-based random keys, split and folded like JAX keys.

A key is a CPU ``int64`` tensor of shape ``(2,)`` (two 64-bit words); deriving keys is a
pure SplitMix64-based function, so a key checkpoints as a tensor leaf. Draw from a key with
:func:`generator`; code on the global RNG (dropout) is deterministic inside :func:`rng_scope`.

Examples:
    >>> k_noise, k_t = split(fold_in(key(0), 7), 2)
    >>> noise = torch.randn(4, generator=generator(k_noise))
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

__all__ = ["fold_in", "fold_in_name", "generator", "is_key", "key", "rng_scope", "seed_of", "split"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """SplitMix64's finaliser: a bijective avalanche mix of one 64-bit word."""
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _words(k: torch.Tensor) -> tuple[int, int]:
    if not is_key(k):
        got = type(k).__name__
        if isinstance(k, torch.Tensor):
            got += f" of shape {tuple(k.shape)} and dtype {k.dtype} on {k.device.type}"
        raise TypeError(
            f"expected an fvstep key (a CPU int64 tensor of shape (2,)), got {got}: "
            "make one with fvstep.random.key(seed)"
        )
    a, b = k.tolist()
    return a & _MASK, b & _MASK


def _make(a: int, b: int) -> torch.Tensor:
    # the two words as signed int64 (inline: every fold_in comes through here)
    top = 1 << 63
    return torch.tensor(
        [a - 2 * top if a >= top else a, b - 2 * top if b >= top else b], dtype=torch.int64
    )


def is_key(x: object) -> bool:
    """Whether ``x`` is an fvstep key: a CPU int64 tensor of shape ``(2,)``."""
    return (
        isinstance(x, torch.Tensor)
        and x.dtype == torch.int64
        and tuple(x.shape) == (2,)
        and x.device.type == "cpu"
    )


def key(seed: int) -> torch.Tensor:
    """Make a key from an integer seed (any Python int; reduced modulo 2**64).

    Raises:
        TypeError: If ``seed`` is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    s = seed & _MASK
    return _make(_mix(s), _mix(s ^ 0xD1B54A32D192ED03))


def fold_in(k: torch.Tensor, data: int) -> torch.Tensor:
    """Derive a new key from ``k`` and an integer (a step, a rank, a micro-batch index).

    Different ``data`` (any int, reduced modulo 2**64) give independent keys; the same
    ``(k, data)`` always gives the same key.
    """
    if isinstance(data, torch.Tensor):
        data = int(data.item())
    if isinstance(data, bool) or not isinstance(data, int):
        raise TypeError(f"fold_in data must be an int, got {type(data).__name__}")
    a, b = _words(k)
    d = _mix(data & _MASK)
    return _make(_mix(a ^ d), _mix(b ^ _mix(d ^ 0x632BE59BD9B4E019)))


def fold_in_name(k: torch.Tensor, name: str) -> torch.Tensor:
    """Derive a new key from ``k`` and a name (a unit's name, a role's name).

    ``fold_in(k, d)`` with ``d`` the first 8 bytes of the name's SHA-256 (UTF-8): the key
    depends on the name alone, whatever carries it, in any process.
    """
    if not isinstance(name, str):
        raise TypeError(f"fold_in_name needs a str, got {type(name).__name__}")
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return fold_in(k, int.from_bytes(digest[:8], "little"))


def split(k: torch.Tensor, num: int = 2) -> tuple[torch.Tensor, ...]:
    """Split ``k`` into ``num >= 1`` independent keys."""
    if num < 1:
        raise ValueError(f"split needs num >= 1, got {num}")
    a, b = _words(k)
    return tuple(_make(_mix(a ^ _mix(2 * i + 1)), _mix(b ^ _mix(2 * i + 2))) for i in range(num))


def seed_of(k: torch.Tensor) -> int:
    """A non-negative 63-bit integer seed derived from ``k`` (for ``manual_seed``)."""
    a, b = _words(k)
    return _mix(a ^ _mix(b)) >> 1


def generator(k: torch.Tensor, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded from ``k`` (not the global RNG)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(k))
    return g


@contextlib.contextmanager
def rng_scope(k: torch.Tensor) -> Iterator[None]:
    """Seed the global CPU (and every CUDA device's) RNG from ``k``; restore it on exit.

    Use it around modules that draw from the global RNG (dropout), so that they are
    deterministic functions of the key.

    Examples:
        >>> with rng_scope(k):
        ...     y = torch.nn.functional.dropout(x, 0.1)
    """
    seed = seed_of(k)
    cpu_state = torch.get_rng_state()
    # Reading the CUDA states initialises CUDA, so a lazily queued seed cannot leak out.
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        # The CPU and CUDA generators directly: torch.manual_seed would also seed other
        # backends (and build a stack trace each call), which this scope does not restore.
        torch.default_generator.manual_seed(seed)
        if cuda_states is not None:
            for generator in torch.cuda.default_generators:
                generator.manual_seed(seed)
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
