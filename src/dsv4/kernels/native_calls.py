"""Every call into a C kernel library goes through `native_call`, so a block of them can be recorded and replayed.

A one-row decode step is ~150 C kernel calls, and on the host every one of them costs more than its own
arithmetic: the Python around it (module calls, `supports` checks, argument packing, output allocation, ctypes'
per-argument conversion through `argtypes`), ~1.5-2 ms of a ~4 ms step on the small config. Inside
`recording()` each call is also appended, with its arguments as given, to the recording; `Replay` turns the
recording into prepared calls: ctypes argument objects converted once, each function called through a pointer
without `argtypes`, so a call costs well under a microsecond of host time. A replay is only as valid as the
pointers it holds: the caller keeps every tensor they address alive and in place (engine/decode_replay.py).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

# The recording of the calls made in this context (None: not recording). A context variable, not a global: a
# recording covers the thread (or task) that opened it and ends with its block.
_RECORDING: ContextVar[list[NativeCall] | None] = ContextVar("dsv4_native_recording", default=None)


@dataclass(frozen=True)
class NativeCall:
    """One call as made: the ctypes function (with its `argtypes`), its arguments, and how its status is checked
    (`check(status, *context)` raises for a non-zero status)."""

    fn: ctypes._CFuncPtr
    args: tuple
    check: Callable[..., None]
    context: tuple


def native_call(fn: ctypes._CFuncPtr, args: tuple, check: Callable[..., None], *context) -> None:
    """fn(*args); a non-zero status goes to `check(status, *context)`, which raises. Recorded inside `recording()`."""
    status = fn(*args)
    recording = _RECORDING.get()
    if recording is not None:
        recording.append(NativeCall(fn, args, check, context))
    if status:
        check(status, *context)


@contextlib.contextmanager
def recording() -> Iterator[list[NativeCall]]:
    """The calls `native_call` makes in this context during the block, in order."""
    calls: list[NativeCall] = []
    token = _RECORDING.set(calls)
    try:
        yield calls
    finally:
        _RECORDING.reset(token)


def _prepared(value, argtype):
    """A call argument as the ctypes object `argtype` would convert it to (arrays and other ctypes objects as given)."""
    if isinstance(value, ctypes._SimpleCData | ctypes.Array):
        return value
    return argtype(value)


class Replay:
    """Recorded calls, prepared to be made again with the same arguments: each function through a bare pointer to it
    (no `argtypes`: the arguments are ctypes objects already, converted here once)."""

    def __init__(self, calls: list[NativeCall]):
        self._calls = []
        for call in calls:
            if call.fn.argtypes is None or len(call.fn.argtypes) != len(call.args):
                raise ValueError(f"{call.fn.__name__}: a replayed call needs argtypes for each of its arguments")
            bare = type(call.fn)(ctypes.cast(call.fn, ctypes.c_void_p).value)
            bare.restype = call.fn.restype
            args = tuple(_prepared(v, t) for v, t in zip(call.args, call.fn.argtypes, strict=True))
            self._calls.append((bare, args, call.check, call.context))
        self._kernels = tuple(str(call.context[0]) if call.context else call.fn.__name__ for call in calls)

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def kernels(self) -> tuple[str, ...]:
        """Each call's kernel, in order: the first item of its status context (the name its errors carry), else the
        function's name."""
        return self._kernels

    def run_call(self, index: int) -> None:
        """Call `index` alone, as `run` makes it (benchmarks/profile_decode.py times the calls one by one)."""
        fn, args, check, context = self._calls[index]
        status = fn(*args)
        if status:
            check(status, *context)

    def run(self) -> None:
        """Every call in order; a non-zero status raises through its check, the calls after it not made."""
        for fn, args, check, context in self._calls:
            status = fn(*args)
            if status:
                check(status, *context)
