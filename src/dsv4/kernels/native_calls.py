"""Every call into a C kernel library goes through `native_call`, so a block of them can be recorded and replayed.

A one-row decode step is ~150 C kernel calls, and on the host every one of them costs more than its own
arithmetic: the Python around it (module calls, `supports` checks, argument packing, output allocation, ctypes'
per-argument conversion through `argtypes`), ~1.5-2 ms of a ~4 ms step on the small config. Inside
`recording()` each call is also appended, with its arguments as given, to the recording; `Replay` turns the
recording into argument blocks, each kernel's arguments converted once, and makes every call of the block from C
(replay_cpu.c) through the kernel's packed twin (packed_call.h): one ctypes call a step. Made one by one through
ctypes, even with their arguments converted beforehand, the ~150 calls of a small-config step cost ~130 us of host
time with warm caches and ~240 us right after the step's weights had streamed through them (2,066 arguments).
A replay is only as valid as the pointers it holds: the caller keeps every tensor they address alive and in place
(engine/decode_replay.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from dsv4.kernels.c_library import compile_library

REPLAY_SOURCE = Path(__file__).with_name("replay_cpu.c")
# packed_call.h's letter for each ctypes argument type a kernel declares, and the member of `PackedArg` it fills.
_LETTERS = {ctypes.c_void_p: "p", ctypes.c_long: "l", ctypes.c_int: "i", ctypes.c_float: "f"}

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


class PackedArg(ctypes.Union):
    """packed_call.h's `packed_arg`: one argument of a call made from a block."""

    _fields_ = [("p", ctypes.c_void_p), ("l", ctypes.c_long), ("i", ctypes.c_int), ("f", ctypes.c_float)]


def bind_packed(lib: ctypes.CDLL, names: tuple[str, ...]) -> None:
    """Attach to each kernel `name` of `lib` (its `argtypes` set) its packed twin (`fn.packed`, an address), which
    `Replay` calls it through.

    Raises:
        RuntimeError: a twin whose `<name>_signature` does not spell the kernel's declared argument types.
    """
    for name in names:
        fn = getattr(lib, name)
        declared = "".join(_LETTERS.get(t, "?") for t in fn.argtypes)
        signature = (ctypes.c_char_p.in_dll(lib, f"{name}_signature").value or b"").decode()
        if signature != declared:
            raise RuntimeError(f"{name}_packed reads its arguments as {signature!r} but {name} is declared with "
                               f"{declared!r} (packed_call.h letters)")
        fn.packed = ctypes.cast(getattr(lib, f"{name}_packed"), ctypes.c_void_p).value


@functools.cache
def _replay_library() -> ctypes.CDLL:
    lib = compile_library(REPLAY_SOURCE)
    lib.replay_calls.restype = ctypes.c_long
    lib.replay_calls.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_int)]
    return lib


def _address(value) -> int | None:
    """A pointer argument as an address: arrays by where they lie, other ctypes objects by their value."""
    if isinstance(value, ctypes.Array):
        return ctypes.addressof(value)
    if isinstance(value, ctypes._SimpleCData):
        return value.value
    return value


def _block(call: NativeCall) -> ctypes.Array:
    """The call's arguments as packed_call.h's block, each in the member its declared type names."""
    argtypes = call.fn.argtypes
    if argtypes is None or len(argtypes) != len(call.args) or getattr(call.fn, "packed", None) is None:
        raise ValueError(f"{call.fn.__name__}: a replayed call needs argtypes for each of its arguments and a "
                         "packed twin (bind_packed)")
    block = (PackedArg * len(call.args))()
    for slot, value, argtype in zip(block, call.args, argtypes, strict=True):
        letter = _LETTERS[argtype]
        if letter == "p":
            slot.p = _address(value)
        else:
            value = value.value if isinstance(value, ctypes._SimpleCData) else value
            setattr(slot, letter, float(value) if letter == "f" else int(value))
    return block


class Replay:
    """Recorded calls, prepared to be made again with the same arguments: their argument blocks built once, and
    the calls made from C in order (replay_cpu.c `replay_calls`), each through its kernel's packed twin."""

    def __init__(self, calls: list[NativeCall]):
        self._blocks = [_block(call) for call in calls]  # kept alive: the C side holds their addresses
        self._held = [call.args for call in calls]  # the arrays the blocks point into
        self._kernels_at = (ctypes.c_void_p * len(calls))(*(call.fn.packed for call in calls))
        self._args_at = (ctypes.c_void_p * len(calls))(*(ctypes.addressof(b) for b in self._blocks))
        self._checks = [(call.check, call.context) for call in calls]
        self._status = ctypes.c_int(0)
        self._run = _replay_library().replay_calls
        self._kernels = tuple(str(call.context[0]) if call.context else call.fn.__name__ for call in calls)

    def __len__(self) -> int:
        return len(self._checks)

    def _calls(self, first: int, count: int) -> None:
        """Calls [first, first + count); a non-zero status goes to its call's check (which raises), as in
        `native_call`."""
        end = first + count
        while first < end:
            failed = self._run(first, end - first, self._kernels_at, self._args_at, ctypes.byref(self._status))
            if failed < 0:
                return
            check, context = self._checks[failed]
            check(self._status.value, *context)
            first = failed + 1

    @property
    def kernels(self) -> tuple[str, ...]:
        """Each call's kernel, in order: the first item of its status context (the name its errors carry), else the
        function's name."""
        return self._kernels

    def run_call(self, index: int) -> None:
        """Call `index` alone, as `run` makes it (benchmarks/profile_decode.py times the calls one by one)."""
        if not 0 <= index < len(self):
            raise IndexError(f"call {index} of a replay of {len(self)} calls")
        self._calls(index, 1)

    def run(self, stop: int | None = None) -> None:
        """The calls before `stop` (None: every call) in order; a non-zero status raises through its check, the
        calls after it not made."""
        self._calls(0, len(self) if stop is None else stop)
