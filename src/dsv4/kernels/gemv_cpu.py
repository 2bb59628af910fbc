"""Few-row products on CPU that read each weight byte once, in its resident layout (gemv_cpu.c).

A decode step of one or a few rows is bound by reading the weights: one-row fp32 `F.linear` streams them
at a fraction of the machine's bandwidth and gains nothing from a second thread, and the torch path of
FP4/FP8 experts dequantises a full fp32 copy per expert per call before its GEMM. These kernels stream the
weights once, split the output features across torch's own intra-op threads, and decode FP8 (e4m3, 128x128
block scales) and FP4 (e2m1, one ue8m0 scale per 32 inputs) weights in registers, never materialising a
dequantised matrix: with many rows per weight (prefill chunks, large batches) each quantized weight row is
decoded once per call into a panel of a few rows (PANEL_NB rows of K floats, on the stack) that every row reads, the
same sums in the same order as the one-row pass, so those products serve any row count. Arithmetic is fp32
(bf16 activations are widened on load and rounded once on store); results differ from the torch references
only by the order of the fp32 sums.

Kernels (each `supports(*args)` / `__call__(*args)` with one signature, as the registry expects):
  DenseGemv         (x, weight): x [R, K] @ weight.T for a [N, K] weight stored input-major ([K, N] storage,
                    `dsv4.model.linear.input_major`), fp32 or bf16 (`supports`: bf16 rows, R <= MAX_BF16_ROWS;
                    fp32 rows on a bf16 weight, R <= MAX_WIDENING_ROWS; fp32 on fp32, R <= MAX_F32_ROWS)
  QuantGemv         (x, weight, scale, block): x [R, K] @ W.T for an output-major FP8 [N, K] (+ fp32 block
                    scales) or FP4 [N, K/2] (+ ue8m0 bytes [N, K/block[1]]) weight
  FusedExperts      (x, ids, weights, w1, w3, w2, limit): one MoE layer's routed experts (dense stacks),
                    the arguments of `loop_experts` over dense stacks
  FusedQuantExperts (x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, block, limit): the same for
                    FP8 / FP4 stacks, format from w1's dtype (float8_e4m3fn: FP8 with `block`; int8: FP4 with
                    group block[1])
  FusedMoeLayer     a decode step's whole MoE layer (router, routed and shared experts), fp32 or bf16
A model module binds its kernel to its weights once, at finalize (`bind`, through `KernelRegistry.bind`:
DenseGemv.bind(weight), FusedExperts / FusedQuantExperts.bind(experts), FusedMoeLayer.bind(router, experts,
shared, eps)): the weights' layout, format and pointers are checked and read there, and the bound kernel's
`supports` / `__call__` take only a call's rows (and routing).

Threads: the library's own caller-runs pool (`WorkerPool`, one per `build_kernels()`). A call is cut into
chunks of output features; the calling thread works through them and the pool's workers join when they get
a core, so a call never waits for a worker that has not started (an OpenMP region, torch's included, waits
at its closing barrier for every thread of the team: on a machine whose other core is busy that costs a
scheduler time slice per region). Workers poll ~50 us for the next call, then sleep. A call uses
`WorkerPool.threads()` threads: a fixed count given to `build_kernels(threads=...)`, the count pinned for a
block (`WorkerPool.pinned_threads`: a one-row step runs torch on one thread while these kernels keep the
threads torch had, `KernelRegistry.threads_for_rows`), or else torch.get_num_threads() at the call, up to
the pool's size + 1.

Build: the C source is compiled once per machine into the per-user kernel cache (about a second; no torch
headers), with -march=native (the cache key includes this CPU's feature flags, so a shared home directory on
a different CPU builds its own copy).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path

import torch

from dsv4.kernels.bf16_products import BF16_MATRIX_UNITS
from dsv4.kernels.c_library import NATIVE, compile_library, cpu_features
from dsv4.kernels.native_calls import bind_packed, native_call

SOURCE = Path(__file__).with_name("gemv_cpu.c")
# The kernels a recorded step may call (native_call), each with a packed twin for the replay (packed_call.h).
REPLAYED = ("dense_xw_shared", "dense_xw", "dense_xw_grouped", "quant_xw", "moe_experts", "moe_layer",
            "argmax_rows", "gather_rows")
_FLAGS = ("-pthread",)  # beyond c_library.BASE_FLAGS
# The library is compiled for this CPU (`march=NATIVE`). With AVX-512 (16-wide) the FP4 rows are decoded with
# vector permutes, with AVX2 + FMA + F16C (8-wide) with byte shuffles; FP8 rows with half-float widening on both;
# without them (or with an older `march`, which the tests use to exercise that path) through per-byte tables.

# Codes shared with gemv_cpu.c.
_ACT = {torch.float32: 0, torch.bfloat16: 1}
_FMT_F32, _FMT_BF16, _FMT_FP8, _FMT_FP4 = 0, 1, 2, 3
_DENSE_FMT = {torch.float32: _FMT_F32, torch.bfloat16: _FMT_BF16}
_ERR_ALLOC, _ERR_ARGS = 1, 2
# vector_isa() of a library built with the AVX-512 / AVX2 decode paths (0: per-byte tables)
VECTOR_ISAS = {512: "AVX-512 permutes / half floats", 256: "AVX2 byte shuffles / F16C", 0: "per-byte tables"}

# Where DenseGemv beats torch's GEMM on the same input-major weight: bf16 one-row products 1.3-3.1x faster
# (benchmarks/bench_gemv.py, small-config shapes, 2 threads, cold weights, shared machine; oneDNN's small-row
# bf16 GEMMs are slow). Several rows: on this project's 2-core AVX2 VM (no bf16 instructions, where torch's
# bf16 GEMM runs at well under 1 GFLOP/s), warm weights, 1 and 2 threads, 128x128 to 4096x1024: 3-54x faster
# at 2-16 rows, 17-22x at 64 (128x128 and 1024x1024); the dsv4-sort speculation's verify chunks, prompt steps
# and MTP prompt pass are such products (issue 12). There torch's GEMM is no longer the alternative: bf16
# products run widened to fp32 (bf16_products.linear), which this kernel beats only at a few rows (1 thread,
# shared AVX2 EPYC, 256x512 to 16384x512 weights: x2.4 faster at 4 rows, equal at 16, 0.5-0.7x at 32-64), so it
# takes up to 16. A CPU with bf16 matrix instructions (AMX, AVX512-BF16) runs oneDNN's bf16 GEMM at its real
# speed, and that crossover was not measured on one: there only the one-row product is taken.
MAX_BF16_ROWS = 1 if BF16_MATRIX_UNITS else 16
# fp32 products: at one row MKL's GEMV is as fast on an idle machine (0.9-1.1x, the 16384x512 head included;
# the small config's batch-1 decode step 0.99x with either), but it runs on torch's OpenMP threads, whose
# static split waits for a thread that has no core when another process keeps one busy. Taking the one-row
# fp32 calls here leaves a batch-1 step no product on OpenMP, so the step can run torch at one thread while
# this pool keeps the others (`KernelRegistry.threads_for_rows`): measured 2-3x faster than OpenMP under
# a co-running load (benchmarks/bench_contention.py), equal idle. Measured, not adopted: with this limit at 16
# the small config's eager decode step ran x1.39 at 4 rows and x1.30 at 16 (bench_versions.py, 1 thread, 5
# pairs), but the few-row kernel and MKL's GEMM sum in different orders, so a prompt's rows would then round
# differently prefilled alone (<= 16 rows) and in a shared batch (more): the shared-prefill and DSpark
# rewind tests, which hold those bit for bit, fail. Raising it needs both paths to sum alike.
MAX_F32_ROWS = 1
# fp32 products of a decode step's rows (each one sequence's next token: `StepPlan.single_tokens`, which the
# caller passes as `decode_rows`) up to this many: the gain above, taken where it cannot split a prompt's rows
# between two summation orders, since a prompt's rows (a prefill chunk, a verify span) never come here. First 16
# (eager decode step x1.52 at b=4, x1.05-1.09 at b=16); 64 since the dense pass's several-row chunks accumulate in
# a contiguous scratch (gemv_cpu.c dense_range): small config, 2 threads, engine decode step with torch at one
# thread through such steps (`KernelRegistry.threads_for_rows`), this limit at 64 against 16: fp32 b=32 24.2 vs
# 26.6-33.2 ms, b=64 38.8 vs 41.0 ms, FP4 experts b=64 34.0 vs 36.3-43.2 ms. Per shape at 64 rows, cold weights:
# the 16384x512 head 1.5x MKL's GEMM, the layers' projections 0.8-1.3x.
MAX_F32_DECODE_ROWS = 64
# Groups one grouped product takes (gemv_cpu.c MAX_SHARED: the weights one dispatch cuts into chunks).
MAX_GROUPS = 16
# fp32 rows against a bf16 weight (`LLM(dtype="bfloat16", activation_dtype="float32")`): the kernel reads the
# bf16 weight once where torch needs a widened fp32 copy of it first (`model.linear.compute_weight`). Measured
# on 128x256, 128x49 and 512x2048 input-major weights, 1 thread, shared machine, vs widen + F.linear: 1.2-3.8x
# faster at 1-4 rows, equal at 8, 0.8x at 16.
MAX_WIDENING_ROWS = 4
# The most rows `DenseGemv.supports` takes, by (activation dtype, weight dtype); pairs not listed decline.
_DENSE_ROWS = {(torch.bfloat16, torch.bfloat16): MAX_BF16_ROWS, (torch.float32, torch.bfloat16): MAX_WIDENING_ROWS,
               (torch.float32, torch.float32): MAX_F32_ROWS}
# bf16 products of a decode step's rows up to this many, whatever MAX_BF16_ROWS allows other rows: a decode step
# whose every op runs in these kernels is replayed (engine/decode_replay.py), which saves more than the products
# lose. Measured on a 2-core AMD EPYC with AVX512-BF16 (small config, bf16, 2 threads; the engine step): b=16
# 16.1 -> 11.2 ms and b=32 19.6 -> 17.3 ms, b=64 28.2 -> 29.7 ms (so not 64), though each product alone runs at
# 0.4-0.8x oneDNN's bf16 GEMM from 8 rows on (this kernel widens to fp32 FMAs where oneDNN uses the bf16 dot
# instructions). A CPU without bf16 matrix units was not measured here (its torch products run widened, which this
# kernel matched at 16 rows and ran at 0.5-0.7x at 32-64: the same trade).
MAX_BF16_DECODE_ROWS = 32
# The most rows `BoundGemv.supports` takes from a decode step's rows, where above `_DENSE_ROWS`.
_DECODE_ROWS = {(torch.float32, torch.float32): MAX_F32_DECODE_ROWS,
                (torch.bfloat16, torch.bfloat16): MAX_BF16_DECODE_ROWS}
# Input width the quantized kernel decodes a weight row into (its stack buffer, MAX_QUANT_K in the C file).
MAX_QUANT_K = 16384
# Most weights one SharedInputGemv call takes (gemv_cpu.c MAX_SHARED).
MAX_SHARED_WEIGHTS = 16
# Most rows SharedInputGemv takes: what it saves is a fixed cost per call, which only a one-row step notices
# (benchmarks/bench_kernel_switch.py --switch shared-input, small config, 2 threads: decode step x1.03-1.07 at
# one row; before this limit x0.97-1.04 at 4 rows and x0.98-0.99 at 16, where each call's own work dwarfs it).
MAX_SHARED_ROWS = 1
# FP4 inputs one decode step reads (16 bytes): an FP4 scale group must be a multiple of it (FP4_STEP in C).
FP4_STEP = 32
# Picks (tokens x k) per expert of the layer up to which the fused dense expert kernel is used, by the stacks'
# dtype: each used expert's weights are read once for all its rows, which wins while the rows per expert are
# few; beyond, the grouped GEMMs (grouped_mm) win. fp32, measured on the small config (E=16, k=2, 2 threads,
# cold weights, quiet machine), fused kernel vs what the model runs without it (GroupedExperts): x2.75 at 16
# tokens (2 picks per expert), x2.6 at 32, x2.2 at 64 to 96, x1.85 at 128, x1.3-1.4 at 256 (32 picks per
# expert), x0.98 at 512, x0.91 at 1024. bf16 x4-13 from 1 to 64 tokens (oneDNN's small bf16 GEMMs are slow).
# fp32 activations on bf16 stacks take the bf16 count (the alternative there is the loop over widened
# experts). FP8 / FP4 stacks have no limit: from PANEL_MIN_ROWS rows per expert
# the C kernel decodes each weight row once per call into a small panel (gemv_cpu.c quant_rows_panel), and it
# beat the dequantizing loop, the alternative, at every size measured (small config, 2 threads, busy shared
# machine: x4-16 at 512 to 4096 tokens, 16 to 256 picks per expert). Against dense fp32 experts of the same
# values (their grouped GEMMs; bench_gemv.py "vs fp32" rows), 1 thread, busy machine: x1.8 at 128 tokens,
# x1.2-1.4 at 256, about equal at 512, x0.7-0.85 at 1024-4096 tokens (MKL's GEMM outruns the panel's
# dot-product blocks once every expert has ~64 rows or more).
MAX_PICKS_PER_EXPERT = {torch.float32: 32, torch.bfloat16: 16}
# Bytes of per-call scratch rows (gathered inputs, gate / up / SwiGLU rows and outputs of every pick) one
# moe_experts call may allocate: larger calls (long prefill chunks) run a slice of tokens at a time. Each token's
# result is computed alone, so slicing changes no value; each slice reads the used experts' weights again.
MAX_EXPERT_SCRATCH_BYTES = 256 * 2**20


def build_library(march: str = NATIVE) -> ctypes.CDLL:
    """Compile gemv_cpu.c once for this machine (cached) and load it.

    Args:
        march: the compiler's -march target ("native": this CPU).

    Returns:
        The loaded library, its argument types set.

    Raises:
        RuntimeError: no C compiler, or the compilation failed (its message included).
        OSError: the library could not be written or loaded.
    """
    lib = compile_library(SOURCE, (*_FLAGS, f"-march={march}"), cpu_features())
    P, L, Int, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.pool_create.restype = P
    lib.pool_create.argtypes = [Int]
    lib.pool_destroy.restype = None
    lib.pool_destroy.argtypes = [P]
    lib.pool_workers.restype = Int
    lib.pool_workers.argtypes = [P]
    lib.vector_isa.restype = Int
    lib.vector_isa.argtypes = []
    lib.dense_xw.restype = Int
    lib.dense_xw.argtypes = [P, P, Int, L, L, P, Int, L, P, Int]
    lib.dense_xw_shared.restype = Int
    lib.dense_xw_shared.argtypes = [P, P, Int, L, L, L, P, P, P, P, Int]
    lib.argmax_rows.restype = Int
    lib.argmax_rows.argtypes = [P, P, L, L, P, Int]
    lib.gather_rows.restype = Int
    lib.gather_rows.argtypes = [P, L, L, P, L, P]
    lib.dense_xw_grouped.restype = Int
    lib.dense_xw_grouped.argtypes = [P, P, Int, L, L, L, P, Int, L, P, Int]
    lib.quant_xw.restype = Int
    lib.quant_xw.argtypes = [P, P, Int, L, L, Int, P, P, L, L, L, P, Int]
    lib.moe_experts.restype = Int
    lib.moe_experts.argtypes = [P, P, Int, L, L, L, L, P, P, L, Int, P, P, P, P, P, P, L, L, F, P, Int]
    lib.moe_layer.restype = Int
    lib.moe_layer.argtypes = [P, P, Int, L, L, L, L, P, Int, Int, P, P, L, P, F, F, L, Int, P, P, P, P, P, P, L, L, F,
                              L, Int, P, P, P, P, Int]
    bind_packed(lib, REPLAYED)
    return lib


class WorkerPool:
    """The C library's caller-runs thread pool: `workers` threads besides the caller, joined at close.

    A forked child inherits the handle but not the threads: there every call runs on the calling thread.

    Args:
        lib: the loaded library.
        workers: threads besides the caller.
        fixed: calls use workers + 1 threads; otherwise torch.get_num_threads() at each call.
    """

    def __init__(self, lib: ctypes.CDLL, workers: int, fixed: bool = False):
        self._lib = lib
        self.handle = lib.pool_create(workers)
        if not self.handle:
            raise MemoryError("gemv_cpu: could not allocate the worker pool")
        self.workers = lib.pool_workers(self.handle)
        # The library's `pool_for(pool, n_chunks, fn, job, threads)`, which other kernel libraries call to run
        # their chunks on these threads (`decode_attention_cpu.attend_decode`).
        self.runner = ctypes.cast(lib.pool_for, ctypes.c_void_p).value
        self.fixed = fixed
        self.pinned: int | None = None  # set by `pinned_threads`: the count calls use meanwhile

    def threads(self) -> int:
        """Threads a call may use now."""
        if self.fixed:
            return self.workers + 1
        return self.pinned if self.pinned is not None else torch.get_num_threads()

    @contextlib.contextmanager
    def pinned_threads(self, threads: int):
        """Calls inside the block use `threads` threads whatever torch's own count is meanwhile."""
        before, self.pinned = self.pinned, threads
        try:
            yield
        finally:
            self.pinned = before

    def close(self) -> None:
        if self.handle:
            self._lib.pool_destroy(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.close()


def _check(status: int, kernel: str) -> None:
    if status == _ERR_ALLOC:
        raise MemoryError(f"{kernel}: could not allocate its scratch rows")
    if status != 0:
        raise ValueError(f"{kernel}: arguments outside what the kernel supports (status {status})")


def _cpu_rows(x: torch.Tensor) -> bool:
    """Eager CPU rows [R, K] without autograd history (the kernels have no backward; a graph torch.compile
    captures cannot call into ctypes: there the torch formulas run). The capture check first: a captured graph
    then guards none of what the other checks read (`mhc_cpu.eager_cpu`)."""
    return (not torch.compiler.is_compiling() and x.is_cpu and x.dim() == 2 and x.dtype in _ACT
            and x.is_contiguous() and x.numel() > 0 and not x.requires_grad)


def _input_major(weight: torch.Tensor) -> bool:
    """A [..., out, in] weight whose storage is [..., in, out] contiguous (`input_major`), from offset 0.
    A matrix by its strides (every Linear's call: a transposed view to test costs ~3x the comparison);
    a size-1 dim with other strides declines, as a layout `input_major` never makes."""
    if weight.dim() == 2:
        return weight.stride() == (1, weight.shape[0]) and weight.storage_offset() == 0
    return weight.transpose(-1, -2).is_contiguous() and weight.storage_offset() == 0


def _quant_format(weight: torch.Tensor) -> int | None:
    if weight.dtype == torch.float8_e4m3fn:
        return _FMT_FP8
    if weight.dtype in (torch.int8, torch.uint8):
        return _FMT_FP4
    return None


def _quant_ok(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], in_features: int) -> bool:
    """FP8 [.., N, K] + fp32 [.., ceil(N/b0), ceil(K/b1)], or FP4 [.., N, K/2] + uint8 [.., N, K/b1]."""
    fmt = _quant_format(weight)
    if fmt is None or weight.device.type != "cpu" or not weight.is_contiguous() or not scale.is_contiguous():
        return False
    if in_features > MAX_QUANT_K or weight.storage_offset() or scale.storage_offset():
        return False
    b0, b1 = block
    n = weight.shape[-2]
    if fmt == _FMT_FP8:
        grid = (-(-n // b0), -(-in_features // b1))
        return scale.dtype == torch.float32 and tuple(scale.shape[-2:]) == grid and weight.shape[-1] == in_features
    return (scale.dtype == torch.uint8 and b1 % FP4_STEP == 0 and in_features % b1 == 0
            and weight.shape[-1] * 2 == in_features
            and tuple(scale.shape[-2:]) == (n, in_features // b1))


class _PoolKernel:
    """A kernel of the library calling through the shared worker pool."""

    _entry = ""  # the C function this kernel calls

    def __init__(self, lib: ctypes.CDLL, pool: WorkerPool):
        self._lib, self._fn, self._pool = lib, getattr(lib, self._entry), pool

    @property
    def pool(self) -> WorkerPool:
        """The worker pool this kernel's calls run on (shared by every kernel of its build)."""
        return self._pool

    def describe(self) -> str:
        """For `dsv4 env`: the decode path and threads of this build."""
        return describe(self._lib, self._pool)


class DenseGemv(_PoolKernel):
    """x [R, K] @ weight.T for an input-major fp32 / bf16 weight [N, K] and fp32 / bf16 rows; `supports`
    accepts the calls where it was measured faster than torch (`_DENSE_ROWS`: bf16 on bf16, R <= MAX_BF16_ROWS;
    fp32 on bf16, R <= MAX_WIDENING_ROWS; fp32 on fp32, R <= MAX_F32_ROWS: as fast as MKL idle
    and not on OpenMP), the call itself runs any row count and every pair. A model's projection binds it to its
    weight once (`bind`, at finalize), so its calls check only their rows."""

    _entry = "dense_xw"

    @staticmethod
    def rows_taken(act: torch.dtype, weight: torch.dtype, decode_rows: bool) -> int:
        """The most rows of activation dtype `act` this kernel takes on weights of dtype `weight` (0: none),
        of a decode step's rows when `decode_rows` (`BoundGemv.supports`)."""
        most = _DENSE_ROWS.get((act, weight), 0)
        return max(most, _DECODE_ROWS.get((act, weight), 0)) if decode_rows else most

    def bind(self, weight: torch.Tensor) -> BoundGemv | None:
        """This kernel fixed to one resident weight, or None when `supports` takes no call on it.

        Args:
            weight: an input-major [N, K] weight (`dsv4.model.linear.input_major`) whose address stays put
                until the next bind (loads and refits copy into it).

        Returns:
            The bound product: its layout, format and pointer read here, once.
        """
        rows = {act: most for (act, dtype), most in _DENSE_ROWS.items() if dtype == weight.dtype}
        if weight.dim() != 2 or weight.requires_grad or not weight.is_cpu or not rows or not _input_major(weight):
            return None
        decode_rows = {act: max(most, _DECODE_ROWS.get((act, weight.dtype), 0)) for act, most in rows.items()}
        return BoundGemv(self._fn, self._pool, weight, rows, decode_rows, self._lib.dense_xw_grouped)

    def supports(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        bound = self.bind(weight)
        return not torch.compiler.is_compiling() and bound is not None and bound.supports(x)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return BoundGemv(self._fn, self._pool, weight, {}, {})(x)


class BoundGemv:
    """DenseGemv on one input-major weight: what depends only on the weight (format, shape, address) is
    decided when it is bound; `supports(x)` checks the rows, `__call__(x)` runs x [R, K] @ weight.T.
    `rows`: the most rows `supports` takes, by activation dtype (`_DENSE_ROWS` of the weight's dtype);
    `decode_rows`: the same for a decode step's rows (`_DECODE_ROWS` where larger). Holds the weight, so the
    address it calls with names live storage."""

    def __init__(self, fn, pool: WorkerPool, weight: torch.Tensor, rows: dict[torch.dtype, int],
                 decode_rows: dict[torch.dtype, int], grouped_fn=None):
        self.weight = weight
        self._fn, self._pool, self._rows, self._decode_rows = fn, pool, rows, decode_rows
        self._grouped_fn = grouped_fn  # the library's dense_xw_grouped (`grouped`), None: no grouped calls
        self.out_features, self.in_features = weight.shape
        N = self.out_features
        self._weight_args = (weight.data_ptr(), _DENSE_FMT[weight.dtype], N)  # pointer, format, N

    def supports(self, x: torch.Tensor, decode_rows: bool = False) -> bool:
        """Eager CPU rows this weight's product runs faster here than in torch (the caller checked that no
        graph is being captured); none while autograd tracks the weight (the kernel has no backward).
        decode_rows: x's rows are a decode step's (each one sequence's next token)."""
        most = (self._decode_rows if decode_rows else self._rows).get(x.dtype, 0)
        return (x.dim() == 2 and x.shape[0] <= most and x.shape[1] == self.in_features
                and x.is_cpu and x.is_contiguous() and x.numel() > 0 and not x.requires_grad
                and not self.weight.requires_grad)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        R = x.shape[0]
        y = x.new_empty(R, self.out_features)
        native_call(self._fn, (self._pool.handle, x.data_ptr(), _ACT[x.dtype], R, self.in_features, *self._weight_args,
                               y.data_ptr(), self._pool.threads()), _check, "dense_xw")
        return y

    def supports_grouped(self, x: torch.Tensor, groups: int, decode_rows: bool = False) -> bool:
        """Whether `grouped(x, groups)` runs here: rows of `groups` * in_features columns, as many as `supports`
        takes of their dtype, groups that divide the outputs, at most MAX_GROUPS of them."""
        most = (self._decode_rows if decode_rows else self._rows).get(x.dtype, 0)
        return (self._grouped_fn is not None and 0 < groups <= MAX_GROUPS
                and self.out_features % groups == 0 and x.dim() == 2 and 0 < x.shape[0] <= most
                and x.shape[1] == groups * self.in_features and x.is_cpu and x.is_contiguous()
                and not x.requires_grad and not self.weight.requires_grad)

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """x [R, groups * K] -> y [R, out_features], group g's K inputs through its own block of the weight's
        rows: y[:, g*N:(g+1)*N] = x[:, g*K:(g+1)*K] @ weight[g*N:(g+1)*N].T (N = out_features / groups), each
        output summed as `__call__` sums it. The attention's grouped low-rank output projection."""
        R, N = x.shape[0], self.out_features // groups
        y = x.new_empty(R, self.out_features)
        pointer, fmt, _ = self._weight_args
        native_call(self._grouped_fn, (self._pool.handle, x.data_ptr(), _ACT[x.dtype], R, groups, self.in_features,
                                       pointer, fmt, N, y.data_ptr(), self._pool.threads()), _check, "dense_xw_grouped")
        return y


class RowArgmax(_PoolKernel):
    """Greedy sampling's argmax: [B, V] fp32 logits -> [B] int64, each row's first largest value (its first NaN
    where it holds one: torch.max(dim=-1)'s indices), rows over the pool. torch's max with indices runs ~9x
    its own amax on CPU (one thread, [16, 16384]: 134 against 14.5 us), a tenth of a decode step at b=64."""

    _entry = "argmax_rows"

    @staticmethod
    def supports(logits: torch.Tensor) -> bool:
        return (not torch.compiler.is_compiling() and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.is_cpu and logits.is_contiguous() and logits.shape[0] > 0 and logits.shape[1] > 0)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        native_call(self._fn, (self._pool.handle, logits.data_ptr(), rows, cols, out.data_ptr(), self._pool.threads()),
                    _check, "argmax_rows")
        return out


class RowGather(_PoolKernel):
    """Embedding rows: table [V, D] and int64 token ids [B] -> the B rows [B, D] as the table holds them (a byte
    copy: what `F.embedding` returns when the activations keep the table's dtype). One C call, so a replayed decode
    step gathers its rows inside the replay (engine/decode_replay.py). A row copy per id, on the caller's thread
    (the pool is not asked)."""

    _entry = "gather_rows"

    @staticmethod
    def supports(table: torch.Tensor, ids: torch.Tensor) -> bool:
        return (not torch.compiler.is_compiling() and table.dim() == 2 and table.is_cpu and table.is_contiguous()
                and ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_cpu and ids.is_contiguous())

    def __call__(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows, width = table.shape
        out = torch.empty(ids.numel(), width, dtype=table.dtype)
        native_call(self._fn, (table.data_ptr(), rows, width * table.element_size(), ids.data_ptr(), ids.numel(),
                               out.data_ptr()), _check, "gather_rows")
        return out


class SharedInputGemv(_PoolKernel):
    """DenseGemv over several input-major weights that multiply the same rows, in one C call
    (`dense_xw_shared`): the results `DenseGemv` gives weight by weight, bit for bit, for one call's fixed
    cost and one split of all their columns over the pool. Bound at finalize to a module's projections of one
    input (a decode layer's q / kv / compressor / indexer projections of its normed input); it takes up to
    MAX_SHARED_ROWS rows that every weight's own DenseGemv takes (the call itself runs any rows)."""

    _entry = "dense_xw_shared"

    def __init__(self, lib: ctypes.CDLL, pool: WorkerPool):
        super().__init__(lib, pool)
        self._single = DenseGemv(lib, pool)  # what each weight's own call would take

    def bind(self, *weights: torch.Tensor) -> BoundSharedGemv | None:
        """This kernel fixed to the weights (one input width), or None when DenseGemv takes none of the
        calls on some weight (its dtype or layout) or they differ in input width."""
        bound = [self._single.bind(weight) for weight in weights]
        if len(bound) < 2 or len(bound) > MAX_SHARED_WEIGHTS or any(b is None for b in bound):
            return None
        if len({b.in_features for b in bound}) != 1:
            return None
        return BoundSharedGemv(self._fn, self._pool, bound)

    def supports(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        bound = self.bind(*weights)
        return not torch.compiler.is_compiling() and bound is not None and bound.supports(x)

    def __call__(self, x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
        return self.bind(*weights)(x)


class BoundSharedGemv:
    """SharedInputGemv fixed to its weights (each a `BoundGemv`): pointer, format and width arrays made once."""

    def __init__(self, fn, pool: WorkerPool, bound: list[BoundGemv]):
        self._fn, self._pool, self._bound = fn, pool, bound
        self.in_features = bound[0].in_features
        count = len(bound)
        self._out_features = [b.out_features for b in bound]
        self._weights = (ctypes.c_void_p * count)(*(b.weight.data_ptr() for b in bound))
        self._formats = (ctypes.c_int * count)(*(_DENSE_FMT[b.weight.dtype] for b in bound))
        self._widths = (ctypes.c_long * count)(*self._out_features)

    def supports(self, x: torch.Tensor, decode_rows: bool = False) -> bool:
        """Up to MAX_SHARED_ROWS rows that every weight's own bound product takes."""
        return x.dim() == 2 and x.shape[0] <= MAX_SHARED_ROWS and all(b.supports(x, decode_rows) for b in self._bound)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        R = x.shape[0]
        ys = [x.new_empty(R, n) for n in self._out_features]
        outputs = (ctypes.c_void_p * len(ys))(*(y.data_ptr() for y in ys))
        native_call(self._fn, (self._pool.handle, x.data_ptr(), _ACT[x.dtype], R, self.in_features, len(ys),
                               self._weights, self._formats, self._widths, outputs, self._pool.threads()),
                    _check, "dense_xw_shared")
        return ys


class QuantGemv(_PoolKernel):
    """x [R, K] @ W.T for an output-major FP8 or FP4 weight W [N, K] decoded in registers."""

    _entry = "quant_xw"

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> bool:
        return _cpu_rows(x) and weight.dim() == 2 and _quant_ok(weight, scale, block, x.shape[1])

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
    ) -> torch.Tensor:
        (R, K), N = x.shape, weight.shape[0]
        y = x.new_empty(R, N)
        native_call(self._fn, (self._pool.handle, x.data_ptr(), _ACT[x.dtype], R, K, _quant_format(weight),
                               weight.data_ptr(), scale.data_ptr(), block[0], block[1], N, y.data_ptr(),
                               self._pool.threads()), _check, "quant_xw")
        return y


def _routing_ok(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor) -> bool:
    """Routing tensors of x's tokens (and for dense stacks few enough picks per expert for the fused kernel to
    win: MAX_PICKS_PER_EXPERT of their dtype)."""
    experts = w1.shape[0]
    routing = (_cpu_rows(x) and ids.dtype == torch.int64 and ids.is_contiguous() and weights.dtype == torch.float32
               and weights.is_contiguous() and ids.dim() == 2 and ids.shape == weights.shape
               and ids.shape[0] == x.shape[0] and experts > 0)
    if _quant_format(w1) is not None:
        return routing
    return routing and ids.numel() <= MAX_PICKS_PER_EXPERT.get(w1.dtype, 0) * experts


def _run_experts(fn, pool, x, ids, weights, inter: int, stacks: tuple) -> torch.Tensor:
    """moe_experts over x's tokens, MAX_EXPERT_SCRATCH_BYTES of scratch rows at a time. `stacks`: the C call's
    expert arguments (`_stack_args`)."""
    (T, D), k = x.shape, ids.shape[1]
    out = torch.empty_like(x)
    per_token = k * (2 * D + 3 * inter) * 4  # fp32 scratch rows of one token's picks (gemv_cpu.c moe_experts)
    step = max(1, MAX_EXPERT_SCRATCH_BYTES // per_token)
    for t0 in range(0, T, step):
        rows = min(step, T - t0)
        native_call(fn, (pool.handle, x[t0].data_ptr(), _ACT[x.dtype], rows, D, inter, k, ids[t0].data_ptr(),
                         weights[t0].data_ptr(), *stacks, out[t0].data_ptr(), pool.threads()), _check, "moe_experts")
    return out


def _stack_args(fmt: int, w1, s1, w3, s3, w2, s2, block: tuple[int, int], limit: float) -> tuple:
    """moe_experts' expert arguments over stacks w1 / w3 / w2 (scales None for dense stacks)."""
    ptr = [None if t is None else t.data_ptr() for t in (s1, s3, s2)]
    return (w1.shape[0], fmt, w1.data_ptr(), ptr[0], w3.data_ptr(), ptr[1], w2.data_ptr(), ptr[2], block[0], block[1],
            float(limit))


class BoundExperts:
    """FusedExperts / FusedQuantExperts on one layer's stacks (their `bind`, at finalize): `supports(x, ids,
    weights)` checks the rows and routing, `__call__` runs them. Holds the stacks, so the addresses it calls
    with name live storage. `most_picks`: by activation dtype it runs, the most (token, expert) picks a call may
    have (None: any; dense stacks win only with few picks per expert, `MAX_PICKS_PER_EXPERT`)."""

    def __init__(self, fn, pool: WorkerPool, held: tuple, in_features: int, inter: int, stacks: tuple,
                 most_picks: dict[torch.dtype, int | None]):
        self._fn, self._pool, self._held, self._inter, self._stacks = fn, pool, held, inter, stacks
        self.in_features, self._most_picks = in_features, most_picks

    def supports(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> bool:
        if x.dtype not in self._most_picks or x.dim() != 2 or x.shape[1] != self.in_features:
            return False
        most = self._most_picks[x.dtype]
        return (x.is_cpu and x.is_contiguous() and x.numel() > 0 and not x.requires_grad and ids.dtype == torch.int64
                and ids.is_contiguous() and weights.dtype == torch.float32 and weights.is_contiguous()
                and ids.dim() == 2 and ids.shape == weights.shape and ids.shape[0] == x.shape[0]
                and (most is None or ids.numel() <= most))

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return _run_experts(self._fn, self._pool, x, ids, weights, self._inter, self._stacks)


# (activation dtype, dense stack dtype) pairs FusedExperts runs: the stacks' own dtype, or fp32 rows on bf16.
_EXPERT_DTYPES = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)}


def _dense_stacks_ok(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> bool:
    """Dense input-major expert stacks w1/w3 [E, I, D], w2 [E, D, I] the kernel runs for x's dtype."""
    if w1.dim() != 3:
        return False
    E, inter, D = w1.shape
    dtypes = w1.dtype == w3.dtype == w2.dtype and (x.dtype, w1.dtype) in _EXPERT_DTYPES
    layouts = dtypes and all(w.device.type == "cpu" and _input_major(w) for w in (w1, w3, w2))
    return layouts and D == x.shape[1] and w3.shape == w1.shape and w2.shape == (E, D, inter)


def _quant_stacks_ok(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, block) -> bool:
    """FP8 / FP4 expert stacks (one format) with their scales, x's width as their input."""
    if w1.dim() != 3:
        return False
    D, inter = x.shape[1], w1.shape[1]
    same = _quant_format(w1) == _quant_format(w3) == _quant_format(w2)
    return (same and w1.shape == w3.shape and w2.shape[:2] == (w1.shape[0], D)
            and _quant_ok(w1, w1_scale, block, D) and _quant_ok(w3, w3_scale, block, D)
            and _quant_ok(w2, w2_scale, block, inter))


class FusedExperts(_PoolKernel):
    """Routed experts of one MoE layer over dense input-major stacks w1/w3 [E, I, D], w2 [E, D, I]."""

    _entry = "moe_experts"

    @staticmethod
    def supports(x, ids, weights, w1, w3, w2, limit) -> bool:
        return w1.dim() == 3 and _routing_ok(x, ids, weights, w1) and _dense_stacks_ok(x, w1, w3, w2)

    def bind(self, experts) -> BoundExperts | None:
        """This kernel fixed to a `model.moe.RoutedExperts`' dense stacks (w1, w3, w2, limit), or None when it
        runs no call on them (their layout checked once, here)."""
        w1, w3, w2 = experts.w1, experts.w3, experts.w2
        D = w1.shape[-1]
        runs = [act for act in _ACT if _dense_stacks_ok(torch.empty(1, D, dtype=act), w1, w3, w2)]
        if not runs:
            return None
        stacks = _stack_args(_DENSE_FMT[w1.dtype], w1, None, w3, None, w2, None, (1, 1), experts.limit)
        most = MAX_PICKS_PER_EXPERT.get(w1.dtype, 0) * w1.shape[0]
        return BoundExperts(self._fn, self._pool, (w1, w3, w2), D, w1.shape[1], stacks, dict.fromkeys(runs, most))

    def __call__(self, x, ids, weights, w1, w3, w2, limit) -> torch.Tensor:
        stacks = _stack_args(_DENSE_FMT[w1.dtype], w1, None, w3, None, w2, None, (1, 1), limit)
        return _run_experts(self._fn, self._pool, x, ids, weights, w1.shape[1], stacks)


class FusedQuantExperts(_PoolKernel):
    """Routed experts of one MoE layer over FP8 or FP4 stacks, decoded in registers (no dequantised copy)."""

    _entry = "moe_experts"

    @staticmethod
    def supports(x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, block, limit) -> bool:
        return (w1.dim() == 3 and _routing_ok(x, ids, weights, w1)
                and _quant_stacks_ok(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, block))

    def bind(self, experts) -> BoundExperts | None:
        """This kernel fixed to a `model.moe.RoutedExperts`' FP8 / FP4 stacks (and scales, quant_block, limit),
        or None when it cannot run them (their layout checked once, here)."""
        w1, w3, w2 = experts.w1, experts.w3, experts.w2
        scales, block = (experts.w1_scale, experts.w3_scale, experts.w2_scale), experts.quant_block
        D = w1.shape[-1] * (1 if _quant_format(w1) == _FMT_FP8 else 2)
        if w1.dim() != 3 or not _quant_stacks_ok(torch.empty(1, D), w1, scales[0], w3, scales[1], w2, scales[2], block):
            return None
        stacks = _stack_args(_quant_format(w1), w1, scales[0], w3, scales[1], w2, scales[2], block, experts.limit)
        return BoundExperts(self._fn, self._pool, (w1, w3, w2, *scales), D, w1.shape[1], stacks, dict.fromkeys(_ACT))

    def __call__(self, x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, block, limit) -> torch.Tensor:
        stacks = _stack_args(_quant_format(w1), w1, w1_scale, w3, w3_scale, w2, w2_scale, block, limit)
        return _run_experts(self._fn, self._pool, x, ids, weights, w1.shape[1], stacks)


# Router scoring functions (ModelConfig.scoring_func) and their codes in gemv_cpu.c's moe_layer.
_SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
# Tokens FusedMoeLayer takes: a decode step's rows, as many as the shared expert's own product takes
# (`DenseGemv.rows_taken`: 64 fp32 rows), and one row of any other call (a prompt's rows stay on the separate
# calls, as its shared expert's product does: a prompt then rounds alike in any chunking). A decode step's every
# other op already runs in these kernels, so its forward is kernel calls only (what engine/decode_replay.py
# replays); at 16 rows the router and shared expert in torch were ~20 ops per layer.
MAX_MOE_LAYER_ROWS = MAX_F32_DECODE_ROWS


class FusedMoeLayer(_PoolKernel):
    """A decode step's whole MoE layer in one call: the router (scores, top-k with correction bias or a hash row,
    normalised scaled weights), its routed experts (dense or FP8 / FP4 stacks, as FusedExperts /
    FusedQuantExperts run them) and the shared expert, fp32 or bf16 rows. A decode step's MoE layer is otherwise
    ~30 torch ops and four kernel calls. A layer binds it to its weights once (`bind`, at finalize): the bound
    kernel's calls take x [T, D] and token_ids [T] and return routed + shared [T, D] (`MAX_MOE_LAYER_ROWS`)."""

    _entry = "moe_layer"

    def bind(self, router, experts, shared, norm_eps: float) -> BoundMoeLayer | None:
        """This kernel fixed to one layer's weights, or None when it cannot run them.

        Args:
            router: the layer's `model.moe.Router`: weight [E, D] input-major (fp32 or bf16), `bias` [E] fp32 or
                (hashed) `tid2eid` [V, k] int32, scoring_func (a ModelConfig.scoring_func), top_k, scaling.
            experts: its `RoutedExperts`: dense input-major or FP8 / FP4 stacks w1, w3, w2 (+ scales), limit.
            shared: its `SharedExpert`: w1 / w3 [Is, D], w2 [D, Is] projections, input-major (fp32 or bf16).
            norm_eps: added to the picked scores' sum.

        Returns:
            The bound layer: every weight's layout checked and its pointer read here, once.
        """
        w1, w3, w2, D = experts.w1, experts.w3, experts.w2, router.weight.shape[1]
        scales = tuple(getattr(experts, f"{name}_scale", None) for name in ("w1", "w3", "w2"))  # None: dense
        x = torch.empty(1, D)  # the layer's stacks checked for one fp32 token (bf16 rows: `acts` below)
        block = experts.quant_block
        stacks = (_dense_stacks_ok(x, w1, w3, w2) if scales[0] is None
                  else _quant_stacks_ok(x, w1, scales[0], w3, scales[1], w2, scales[2], block))
        E, top_k, bias = w1.shape[0] if w1.dim() == 3 else 0, router.top_k, getattr(router, "bias", None)
        hash_table = router.tid2eid if router.hashed else None
        if hash_table is not None:
            routing = (hash_table.dtype == torch.int32 and hash_table.dim() == 2 and hash_table.shape[1] == top_k
                       and hash_table.is_contiguous())
        else:
            routing = bias.dtype == torch.float32 and tuple(bias.shape) == (E,) and bias.is_contiguous()
        sw1, sw3, sw2 = shared.w1.weight, shared.w3.weight, shared.w2.weight
        inter = sw1.shape[0]
        shared_ok = (all(w.dim() == 2 and w.dtype in _DENSE_FMT and w.device.type == "cpu" and _input_major(w)
                         for w in (sw1, sw3, sw2))
                     and tuple(sw1.shape) == tuple(sw3.shape) == (inter, D) and tuple(sw2.shape) == (D, inter))
        rw = router.weight
        if not (stacks and routing and shared_ok and router.scoring_func in _SCORING and 0 < top_k <= E
                and rw.dtype in _DENSE_FMT and rw.device.type == "cpu" and _input_major(rw)):
            return None
        fmt = _DENSE_FMT[w1.dtype] if scales[0] is None else _quant_format(w1)
        ptr = [None if t is None else t.data_ptr() for t in scales]
        routing_args = (D, E, top_k, rw.data_ptr(), _DENSE_FMT[rw.dtype], _SCORING[router.scoring_func],
                        None if hash_table is not None else bias.data_ptr(),
                        None if hash_table is None else hash_table.data_ptr(),
                        0 if hash_table is None else hash_table.shape[0])
        expert_args = (float(router.scaling), float(norm_eps), w1.shape[1], fmt, w1.data_ptr(), ptr[0],
                       w3.data_ptr(), ptr[1], w2.data_ptr(), ptr[2], block[0], block[1], float(experts.limit),
                       inter, _DENSE_FMT[sw1.dtype], sw1.data_ptr(), sw3.data_ptr(), sw2.data_ptr())
        held = (rw, bias, hash_table, w1, w3, w2, *scales, sw1, sw3, sw2)
        # bf16 rows only where the layer's weights are bf16 at rest (dense experts, shared expert) or quantized:
        # the reference rounds a wider weight to the rows' dtype per call, which the kernel does not.
        acts = {torch.float32}
        if all(w.dtype == torch.bfloat16 for w in (sw1, sw3, sw2)) and (scales[0] is not None
                                                                         or w1.dtype == torch.bfloat16):
            acts.add(torch.bfloat16)
        # Decode rows per activation dtype: those the shared expert's own product takes, and for dense stacks
        # few enough picks per expert (MAX_PICKS_PER_EXPERT) for the fused expert kernel to win.
        decode_rows = {}
        for act in acts:
            most = min(MAX_MOE_LAYER_ROWS, DenseGemv.rows_taken(act, sw1.dtype, decode_rows=True))
            if scales[0] is None:
                most = min(most, MAX_PICKS_PER_EXPERT.get(w1.dtype, 0) * E // top_k)
            decode_rows[act] = max(1, most)
        return BoundMoeLayer(self._fn, self._pool, held, routing_args, expert_args, hash_table is not None,
                             decode_rows)


class BoundMoeLayer:
    """FusedMoeLayer on one layer's weights (`FusedMoeLayer.bind`): `supports(x, token_ids, decode_rows)` checks the
    tokens, `__call__` runs the layer. Holds the weights, so the addresses it calls with name live storage."""

    def __init__(self, fn, pool: WorkerPool, held: tuple, routing_args: tuple, expert_args: tuple, hashed: bool,
                 decode_rows: dict[torch.dtype, int]):
        """decode_rows: by activation dtype it runs, the most rows of a decode step a call takes (others: one)."""
        self._fn, self._pool, self._held, self._decode_rows = fn, pool, held, decode_rows
        self._routing_args, self._expert_args, self._hashed = routing_args, expert_args, hashed
        self.in_features = routing_args[0]

    def supports(self, x: torch.Tensor, token_ids: torch.Tensor, decode_rows: bool = False) -> bool:
        """Eager CPU tokens of the layer's width, fp32 or (on bf16 or quantized weights) bf16: one, or up to
        `MAX_MOE_LAYER_ROWS` of a decode step's rows (`decode_rows`); a hashed layer's token ids int64."""
        most = self._decode_rows.get(x.dtype, 0) if decode_rows else int(x.dtype in self._decode_rows)
        return (x.dim() == 2 and 0 < x.shape[0] <= most and x.shape[1] == self.in_features and x.is_cpu
                and x.is_contiguous() and not x.requires_grad
                and (not self._hashed or (token_ids.shape == x.shape[:1] and token_ids.dtype == torch.int64
                                          and token_ids.is_cpu and token_ids.is_contiguous())))

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        tokens = token_ids.data_ptr() if self._hashed else None  # read by the kernel: a replay reads the step's
        native_call(self._fn, (self._pool.handle, x.data_ptr(), _ACT[x.dtype], x.shape[0], *self._routing_args,
                               tokens, *self._expert_args, out.data_ptr(), self._pool.threads()), _check, "moe_layer")
        return out


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        return os.cpu_count() or 1


def pool_call_args(pool: WorkerPool | None) -> tuple[int | None, int | None, int]:
    """(pool handle, its `pool_for`, threads a call may use now): the last three arguments of another kernel
    library's call that spreads its rows over `pool` (None, or a closed pool: (None, None, 1), the caller's
    thread alone)."""
    if pool is None or not pool.handle:
        return None, None, 1
    return pool.handle, pool.runner, pool.threads()


def build_kernels(threads: int | None = None) -> tuple[DenseGemv, QuantGemv, FusedExperts, FusedQuantExperts,
                                                      FusedMoeLayer, SharedInputGemv, RowArgmax, RowGather]:
    """All eight kernels over one build of the library and one worker pool.

    Args:
        threads: threads every call uses (the pool gets threads - 1 workers); None: the pool gets a worker
            per usable CPU but one (idle workers sleep) and each call uses torch.get_num_threads() at that
            moment, so a later torch.set_num_threads is followed.

    Raises:
        As `build_library` does; MemoryError if the pool cannot be allocated.
    """
    lib = build_library()
    pool = WorkerPool(lib, (threads or usable_cpus()) - 1, fixed=threads is not None)
    return (DenseGemv(lib, pool), QuantGemv(lib, pool), FusedExperts(lib, pool), FusedQuantExperts(lib, pool),
            FusedMoeLayer(lib, pool), SharedInputGemv(lib, pool), RowArgmax(lib, pool), RowGather(lib, pool))


@functools.cache
def shared_kernels() -> tuple[DenseGemv, QuantGemv, FusedExperts, FusedQuantExperts, FusedMoeLayer,
                              SharedInputGemv, RowArgmax, RowGather]:
    """The process's one set of kernels (`build_kernels()`): every kernel registry hands these out, so a
    process runs one worker pool however many models it builds, as torch runs one intra-op pool."""
    return build_kernels()


def describe(lib: ctypes.CDLL, pool: WorkerPool) -> str:
    """For `dsv4 env`: the instruction set the FP8/FP4 decode was built for and the threads a call uses."""
    decode = VECTOR_ISAS[lib.vector_isa()]
    threads = f"{pool.workers + 1} threads" if pool.fixed else "torch.get_num_threads() threads"
    return f"FP8/FP4 decode by {decode}; {threads} (caller-runs pool of {pool.workers} workers)"
