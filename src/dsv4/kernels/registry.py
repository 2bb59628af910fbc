"""Kernel registry: for each op, an ordered list of backends (fast first, the torch reference last).

A backend's `build` either returns the implementation or raises, with the reason it cannot run here;
the first backend that builds wins, and the reference (plain readable torch, the oracle every fast
path is tested against) always builds. `describe_backends()` reports each choice and why, for
`dsv4 env`. Set DSV4_KERNELS=reference to force the reference path everywhere (debugging, bisecting).

Every backend's implementation has one calling convention: `impl.supports(*args)` takes exactly the
arguments of the call it gates (`impl(*args)`, or the named entry point such as `MhcFusedKernel.pre`) and
says whether this call can run there (device, dtype, shape, not inside a torch.compile graph for a C
kernel; the registry itself declines those ops' calls in a graph, `GRAPH_OPS`). Callers ask
`registry.kernel(op, *args)`, which returns the implementation when it supports the call and None when the
caller's own torch reference must run it. What depends only on a module's weights is decided once instead:
at finalize the module asks `registry.bind(op, *weights)` for the implementation fixed to them (its `bind`),
whose `supports` then checks only a call's rows; a graph being captured runs the module's torch code.

The model gets its registry when it is built (`DeepseekV4(..., kernels=...)`, `load_models(..., kernels=...)`,
`LLM(..., kernels=...)`; drafters use their target's): tests and tools pass their own, e.g. training builds its
models with `KernelRegistry(force_reference=True)` (the fast paths are inference kernels without a backward);
`default_registry()` is the process-wide one used when none is given. Nothing changes a registry's choices
after they are made.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

FORCE_ENV = "DSV4_KERNELS"
REFERENCE = "reference"

MHC_COEFFICIENTS = "mhc_coefficients"
MOE_EXPERTS = "moe_experts"
MHC_FUSED = "mhc_fused"
MHC_HEAD = "mhc_head"
NORM_ROPE = "norm_rope"
LINEAR = "linear"
SHARED_INPUT_LINEAR = "shared_input_linear"
FEW_ROW_EXPERTS = "few_row_experts"
QUANT_EXPERTS = "quant_experts"
MOE_LAYER = "moe_layer"
DECODE_ATTENTION = "decode_attention"
GREEDY_ARGMAX = "greedy_argmax"
EMBEDDING_ROWS = "embedding_rows"

# Ops whose fast backends run inside a graph torch.compile captures (torch code: fixed-shape expert strategies).
# Every other op's fast path is a C kernel called through ctypes, which a graph cannot trace: there `kernel`
# declines before looking at the choice, so a compiled graph guards nothing of the kernel objects (each
# `supports` a captured step traced cost ~5 guards on the implementation's type and code).
GRAPH_OPS = frozenset({MOE_EXPERTS})

# Forwards of at most this many rows run torch at one intra-op thread (`threads_for_rows`): the rows whose
# every product the few-row kernels take at any dtype (gemv_cpu's MAX_F32_ROWS and MAX_BF16_ROWS).
ONE_THREAD_TORCH_ROWS = 1


@dataclass(frozen=True)
class Backend:
    name: str
    build: Callable[[], object]  # -> implementation, or raises with the reason it is unavailable
    summary: str


@dataclass(frozen=True)
class Choice:
    op: str
    backend: str
    impl: object | None  # None for the reference: callers run their own torch code
    reason: str

    @property
    def is_reference(self) -> bool:
        return self.backend == REFERENCE


def _build_mhc_cpu():
    from dsv4.kernels.mhc_cpu import MhcCpuKernel, build_library

    return MhcCpuKernel(build_library())


def _build_mhc_fused():
    from dsv4.kernels.mhc_cpu import MhcFusedKernel, build_library

    return MhcFusedKernel(build_library(), _few_row_pool())


def _build_mhc_head():
    from dsv4.kernels.mhc_cpu import MhcHeadKernel, build_library
    return MhcHeadKernel(build_library(), _few_row_pool())


def _build_norm_rope():
    from dsv4.kernels.norm_rope_cpu import NormRopeKernel, build_library

    return NormRopeKernel(build_library())


def _few_row_pool():
    """The few-row kernels' worker pool, which other C kernels spread their rows over (one set of threads for
    every kernel), or None where their library does not build (those kernels then run on the caller's thread)."""
    from dsv4.kernels.gemv_cpu import shared_kernels

    try:
        return shared_kernels()[0].pool
    except (RuntimeError, OSError, MemoryError):
        return None


def _build_decode_attention():
    from dsv4.kernels.decode_attention_cpu import DecodeAttentionKernel, build_library

    return DecodeAttentionKernel(build_library(), _few_row_pool())


def _build_grouped_experts():
    from dsv4.kernels.gathered_experts import build_grouped_experts

    return build_grouped_experts()


def _build_few_row(index: int):
    """One of gemv_cpu's kernels; they share one build of the library and one worker pool."""
    from dsv4.kernels.gemv_cpu import shared_kernels

    return shared_kernels()[index]


def _build_gathered_experts():
    from dsv4.kernels.gathered_experts import GatheredExperts

    return GatheredExperts()


_BACKENDS: dict[str, tuple[Backend, ...]] = {
    MHC_COEFFICIENTS: (
        Backend("cpu_c", _build_mhc_cpu, "one C loop per call (ctypes; fp32 CPU), replaces ~120 torch ops"),
    ),
    MHC_FUSED: (
        Backend("cpu_c", _build_mhc_fused,
                "mHC pre (RMS, coefficients, collapse, norm) and post as one C call each; "
                "fp32 or bf16 streams, updated in place"),
    ),
    MHC_HEAD: (
        Backend("cpu_c", _build_mhc_head,
                "the final pre-only mHC collapse (hc_head: RMS, sigmoid coefficients, collapse) as one C call after "
                "the mix; fp32 or bf16 streams"),
    ),
    NORM_ROPE: (
        Backend("cpu_c", _build_norm_rope,
                "RMSNorm and/or interleaved RoPE in place, one C call (fp32 or bf16 CPU, fp32 arithmetic)"),
    ),
    LINEAR: (
        Backend("cpu_c", functools.partial(_build_few_row, 0),
                "few-row products on input-major weights (gemv_cpu.c DenseGemv): one-row fp32 calls, bf16 calls up "
                "to MAX_BF16_ROWS rows, and fp32 rows on bf16 weights up to a few rows"),
    ),
    SHARED_INPUT_LINEAR: (
        Backend("cpu_c", functools.partial(_build_few_row, 5),
                "a one-row decode layer's projections of one input (its normed input, its q rows) in one C call, "
                "each weight's own product bit for bit (gemv_cpu.c dense_xw_shared)"),
    ),
    FEW_ROW_EXPERTS: (
        Backend("cpu_c", functools.partial(_build_few_row, 2),
                "dense routed experts of a few tokens in one C call, each used expert's weights read once "
                "(gemv_cpu.c FusedExperts)"),
    ),
    QUANT_EXPERTS: (
        Backend("cpu_c", functools.partial(_build_few_row, 3),
                "FP8 / FP4 routed experts at any batch, decoded in registers (many rows per expert: a few weight "
                "rows at a time into a per-call panel), no dequantised copy (gemv_cpu.c FusedQuantExperts)"),
    ),
    MOE_LAYER: (
        Backend("cpu_c", functools.partial(_build_few_row, 4),
                "a decode step's MoE layer (router, routed and shared experts of up to 64 rows), fp32 or bf16, "
                "in one C call (gemv_cpu.c FusedMoeLayer)"),
    ),
    DECODE_ATTENTION: (
        Backend("cpu_c", _build_decode_attention,
                "single-token decode rows of a layer's attention (compressor rings and entries, window ring, "
                "indexer top-k, attention with the sink) in C, fp32: three calls instead of ~100 torch ops"),
    ),
    GREEDY_ARGMAX: (
        Backend("cpu_c", functools.partial(_build_few_row, 6),
                "greedy sampling's argmax of fp32 logits rows, the first largest id (gemv_cpu.c argmax_rows), "
                "rows over the few-row kernels' pool"),
    ),
    EMBEDDING_ROWS: (
        Backend("cpu_c", functools.partial(_build_few_row, 7),
                "a replayed decode step's embedding rows, copied from the table by one C call inside the replay "
                "(gemv_cpu.c gather_rows)"),
    ),
    MOE_EXPERTS: (
        Backend("grouped_mm", _build_grouped_experts,
                "dense experts: rows sorted by expert, one torch._grouped_mm per matrix"),
        Backend("gathered", _build_gathered_experts,
                "small dense batches: gathered expert weights + bmm, no per-expert loop"),
    ),
}


class KernelRegistry:
    """Resolves each op once (lazily) to its first buildable backend."""

    def __init__(self, force_reference: bool = False):
        self.force_reference = force_reference
        self._choices: dict[str, Choice] = {}

    def choose(self, op: str) -> Choice:
        if op not in _BACKENDS:
            raise KeyError(f"unknown kernel op {op!r}; known: {', '.join(_BACKENDS)}")
        if op not in self._choices:
            self._choices[op] = self._resolve(op)
        return self._choices[op]

    def resolve_all(self) -> None:
        """Resolve every op now: a graph torch.compile captures then only reads the choices (building a
        backend compiles C code, which a graph cannot trace)."""
        for op in _BACKENDS:
            self.choose(op)

    def kernel(self, op: str, *args):
        """The op's fast implementation when it supports this call (`supports(*args)`, the call's own
        arguments), else None: the caller runs its torch reference (always, for a C kernel's op inside a graph
        being captured: GRAPH_OPS)."""
        if op not in GRAPH_OPS and torch.compiler.is_compiling():
            return None
        impl = self.choose(op).impl
        return impl if impl is not None and impl.supports(*args) else None

    def bind(self, op: str, *weights):
        """The op's fast implementation fixed to one module's weights (`impl.bind(*weights)`: what depends only
        on them decided once, at finalize), or None when the op has none or it runs no call on them. A bound
        kernel's `supports` then takes only a call's rows."""
        impl = self.choose(op).impl
        return None if impl is None else impl.bind(*weights)

    def _resolve(self, op: str) -> Choice:
        if self.force_reference:
            return Choice(op, REFERENCE, None, f"{FORCE_ENV}={REFERENCE}")
        failures = []
        for backend in _BACKENDS[op]:
            try:
                impl = backend.build()
            except Exception as exc:  # any build failure means "fall back", with the reason shown
                failures.append(f"{backend.name}: {type(exc).__name__}: {exc}")
                continue
            detail = getattr(impl, "describe", None)  # a build's own details (instruction set, threads)
            return Choice(op, backend.name, impl, backend.summary + (f"; {detail()}" if detail else ""))
        return Choice(op, REFERENCE, None, "fallback (" + "; ".join(failures) + ")")

    def threads_for_rows(self, rows: int, decode_rows: bool = False,
                         dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)):
        """A context for a forward of `rows` rows: with at most ONE_THREAD_TORCH_ROWS rows, or a decode step
        (`decode_rows`) of at most the rows whose products the few-row kernels take for its (activation,
        weight) `dtypes`, and those kernels built, torch's intra-op pool runs one thread for the block and those
        kernels' pool keeps the threads torch had; otherwise nothing changes.

        Why: at one row every product runs in the few-row kernels (caller-runs: a call never waits for a
        worker without a core) and torch's remaining ops are too small to split, but an OpenMP region of
        two threads still waits at its barrier for both; when another process keeps a core busy, that wait
        is a scheduler time slice per region (measured: batch-1 decode 2-3x slower, steps up to 20x).
        Why also the decode steps of several rows: their products run in the few-row kernels too (the
        experts' and attention's in kernels of their own, torch keeps only small ops), and torch's OpenMP
        threads, which spin for a while after each parallel region, would take the core the kernels' worker
        needs: measured on the small config, fp32, 2 threads, b=16, the 16384x512 head 3.0 -> 2.0 ms and the
        engine step 17.3 -> 16.3 ms with torch at one thread.
        """
        impl = self.choose(LINEAR).impl
        threads = torch.get_num_threads()
        if impl is None or threads == 1:
            return contextlib.nullcontext()
        most = max(ONE_THREAD_TORCH_ROWS, impl.rows_taken(*dtypes, decode_rows=True)) if decode_rows else \
            ONE_THREAD_TORCH_ROWS
        if rows > most:
            return contextlib.nullcontext()
        return _torch_threads_pinned(impl.pool, threads)

    def few_row_threads(self) -> int | None:
        """Threads a call of the few-row kernels' pool uses now (None: those kernels are not built)."""
        impl = self.choose(LINEAR).impl
        return None if impl is None else impl.pool.threads()

    def describe(self) -> list[str]:
        width = max(map(len, _BACKENDS))
        return [f"{op:{width}s} {c.backend:10s} {c.reason}" for op in _BACKENDS for c in (self.choose(op),)]


@contextlib.contextmanager
def _torch_threads_pinned(pool, threads: int):
    """torch at one intra-op thread for the block, `pool` at `threads`; torch's count restored after."""
    with pool.pinned_threads(threads):
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@functools.cache
def default_registry() -> KernelRegistry:
    """The process-wide registry (built on first use, honouring DSV4_KERNELS): what a model built without
    its own registry uses."""
    return KernelRegistry(force_reference=os.environ.get(FORCE_ENV, "").strip().lower() == REFERENCE)


def describe_backends() -> str:
    """Text for `dsv4 env`: the chosen backend of every op and why."""
    from dsv4.kernels.bf16_products import describe as describe_bf16

    return "\n".join(["kernel backends (op, backend, why):", *("  " + line for line in default_registry().describe()),
                      "  " + describe_bf16()])
