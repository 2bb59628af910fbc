"""The load step: (name, tensor) pairs -> validated, converted values -> in-place writes.

Every load format (checkpoint files, dummy values, refit buckets) goes through `WeightWriter`, so name
mapping, pairing of weights with their scales, validation and conversion exist once.

Cost model (what makes a load or a refit cost what its bytes cost):
  * names resolve through the models' RouteTable: one dict lookup per tensor;
  * every value check reads the incoming tensor once (convert.py), before anything that serves is written; an atomic
    refit checks float values while it copies them into their staging buffer (nothing reads it before
    `commit()`), so validating and staging them is one read;
  * a tensor already in the resident format is copied straight into its destination: fail-stop refits
    and loads write in place with no intermediate copy, atomic refits copy once into a staging buffer
    (`staged=True`) and once more at `commit()`; a checkpoint load reads such a tensor from its file
    straight into the destination (`destination()`), and checks its values there;
  * a fresh load (`fresh=True`: nothing reads the models before it returns, and a failed load discards
    them) and a fail-stop refit (the models serve nothing from its first write on, nor after a failure)
    check float values inside the copy that writes them, as an atomic refit checks them inside its staging
    copy: one read of the values;
  * resident tensors (allocated by the build) and staging buffers are `WeightArena` memory: never
    zero-filled, faulted in by huge pages on the first write (fresh 4 KiB pages cost more than the copy),
    and staging buffers are kept from one atomic update to the next (`StagingBuffers`);
  * row-major values into an input-major weight, and FP8 codes into a float weight, take one tiled pass
    (`layout_copy`'s C kernels; torch's strided copy of a transposed matrix costs 10-20x a memcpy);
  * the copies that stage floats, and an atomic commit, store with streaming (non-temporal) stores (a
    fresh load's do not: see `_float_values`):
    nothing reads a staging buffer before the commit, nor a weight before the update ends, and by then
    the rest of the update has evicted it, so a cached store would only read each destination line in
    first (staging floats ~1.3x faster on the small benchmark model). The commit copies every staging
    buffer laid out like its destination as raw bytes in one C call (a torch copy per tensor measured
    ~1.5x that call on the small model's ~1000 tensors);
  * float values for FP8 / FP4 experts go through the quantizer, whose finiteness check is fused in.
A weight already in its resident quantized format is written as soon as it arrives; its scale may come
later (another bucket, another file). Only a half that needs its partner to be converted (e.g. FP8 bytes
for a dense parameter) or a scale that arrives before its weight waits in the writer; `own_pending()`
copies those few out of the caller's buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4.config import DENSE, FP4, FP8
from dsv4.errors import CheckpointError
from dsv4.lazy_memory import WeightArena
from dsv4.quant import fp8_scale_grid_shape
from dsv4.weights.convert import (
    E4M3,
    E8M0_DTYPES,
    FLOAT_DTYPES,
    INT_DTYPES,
    PACKED_DTYPES,
    ConversionError,
    QuantLayout,
    check_expert_table,
    check_finite,
    check_fp8_codes,
    check_shape,
    copy_finite_into,
    copy_into,
    dequantize,
    e8m0_bytes,
    fp8_scale_values,
    quantize_expert,
)
from dsv4.weights.layout_copy import copy_bytes_streamed, laid_out_alike
from dsv4.weights.names import ALIASED_DRAFTER_TENSORS, split_stacked
from dsv4.weights.routes import SCALE, STACKED, WEIGHT, Route, RouteTable
from dsv4.weights.shards import ShardSlicer
from dsv4.weights.slots import FLOAT, TABLE, Slot

__all__ = ["ALIASED_DRAFTER_TENSORS", "WeightWriter"]  # the alias pattern is re-exported for `dsv4 inspect`

# (source address, destination address, bytes): a copy between tensors laid out alike (`layout_copy`).
RawCopy = tuple[int, int, int]
# Incoming dtype that is a resident quantized format's own bytes, per expert format.
_NATIVE_BYTES = {FP4: PACKED_DTYPES, FP8: (E4M3,)}


class StagingBuffers:
    """An atomic update's staging buffer per destination, kept for the next update.

    A buffer in fresh memory costs its page faults on every update (on a VM several times the copy into
    it); an RL loop updates the same tensors every step, so the second and later updates of a tensor reuse
    the buffer the first allocated. The price is that memory (one copy of the tensors atomic updates
    carry, the same peak each update needs anyway) held between updates; `clear()` gives it back, and the
    next atomic update allocates again. One update at a time uses them (the engine opens one session at
    a time).
    """

    def __init__(self):
        self._memory = WeightArena()
        # id(dest) -> (dest, buffer, its commit as a raw copy); dest kept alive: its id cannot be reused meanwhile
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, RawCopy | None]] = {}

    def buffer(self, dest: torch.Tensor) -> tuple[torch.Tensor, RawCopy | None]:
        """The staging buffer of `dest` (a resident destination view the route table holds), with its
        shape, dtype and strides, and the commit's copy of it into `dest` as raw bytes (None where the two
        are not laid out alike in CPU memory: the commit then copies it as a tensor)."""
        kept = self._buffers.get(id(dest))
        if kept is not None:
            return kept[1], kept[2]
        buffer = self._memory.zeros_like(dest) if dest.device.type == "cpu" else torch.empty_like(dest)
        raw = (buffer.data_ptr(), dest.data_ptr(), dest.nbytes) if laid_out_alike(dest, buffer) else None
        self._buffers[id(dest)] = (dest, buffer, raw)
        return buffer, raw

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for _, buffer, _ in self._buffers.values())

    def clear(self) -> None:
        """Give the buffers back (their memory goes once no staged value refers to it)."""
        self._buffers.clear()
        self._memory.release()


@dataclass
class _Pending:
    """Half of a weight/scale pair that waits for the other half."""

    weight: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    origin: str = ""
    owned: bool = False  # copies made by own_pending(): safe past the caller's reuse of its buffers


class WeightWriter:
    """Writes incoming (name, tensor) pairs into the models' resident tensors.

    Args:
        routes: the models' route table (`LoadedModels.routes()`).
        layout: quantization layout (block sizes, scale rounding rule) of on-the-fly conversions.
        error_type: raised for bad input (CheckpointError for loads, WeightUpdateError for refits).
        staged: write into staging buffers that `commit()` applies (atomic refits); otherwise in place.
        staging: where staged values are copied (kept across updates); a fresh set when None.
        dry_run: check names, shapes, dtypes and pairing only: read no value, write nothing (works on meta
            tensors built from safetensors headers). A failed `load()` leaves the writer as it was, so a
            caller can collect every problem of a checkpoint.
        before_first_write: called once, right before the first resident byte is written.
        shard: a tensor / expert parallel rank's slicer: incoming tensors are full, and only this rank's
            part of each is validated and written (`weights/shards.py`).
        fresh: the models are being loaded, not updated: nothing reads them before the load returns and a
            failed load discards them, so a value may be checked as it is written (one pass: float values
            are checked inside the copy), and a tensor that is its resident bytes as they are may be read
            straight into its destination first (`destination`).
    """

    def __init__(
        self,
        routes: RouteTable,
        layout: QuantLayout,
        error_type: type[Exception] = CheckpointError,
        *,
        staged: bool = False,
        staging: StagingBuffers | None = None,
        dry_run: bool = False,
        before_first_write: Callable[[], None] | None = None,
        shard: ShardSlicer | None = None,
        fresh: bool = False,
    ):
        self.routes = routes
        self.table = routes.table
        self.layout = layout
        self.error_type = error_type
        self.staged = staged
        self.dry_run = dry_run
        self._before_first_write = before_first_write
        self.shard = shard
        self.fresh = fresh and not staged and not dry_run
        self.wrote = False  # whether any resident byte was written
        self.written: set[str] = set()  # native names of completed slots
        self.ignored: set[str] = set()
        self._completed: dict[Slot, str] = {}  # slot -> origin of the tensor that completed it
        self._awaiting_scale: dict[Slot, str] = {}  # quantized bytes written, scale not yet
        self._pending: dict[Slot, _Pending] = {}
        # (resident destination, staged value, the commit's raw copy of it or None: `StagingBuffers.buffer`)
        self._staging: list[tuple[torch.Tensor, torch.Tensor, RawCopy | None]] = []
        self._staging_buffers = (StagingBuffers() if staging is None else staging) if staged else None

    # ---- loading ----
    def destination(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Where an incoming tensor's bytes may be placed as they are, before `load()` sees it: its resident
        destination viewed as `dtype` and `shape`, when the tensor is that destination's bytes unchanged
        (resident FP8 / FP4 expert bytes, an FP4 expert's ue8m0 scale, a float tensor of the resident dtype
        and contiguous layout). The caller fills it, then passes it to `load()`, which checks its values
        there (FP8 NaN codes, the e8m0 NaN byte, finiteness) and copies nothing. None when the tensor must
        be converted, transposed, paired first, sliced for a shard, when the models are not fresh, or when
        the destination is not CPU memory (the kernel reads the file into the caller's address space).
        """
        if not self.fresh or self.shard is not None:
            return None
        route = self.routes.resolve(name)
        if route is None:
            return None
        slot = route.slot
        if route.kind == WEIGHT and slot.kind in (FLOAT, DENSE):
            dest = slot.dest if dtype == slot.dest.dtype else None
        elif route.kind == WEIGHT:
            dest = slot.dest if dtype in _NATIVE_BYTES.get(slot.kind, ()) else None
        elif route.kind == SCALE and slot.kind == FP4:
            dest = slot.scale_dest if dtype in E8M0_DTYPES else None
        else:
            return None
        if dest is None or dest.shape != shape or not dest.is_contiguous() or dest.device.type != "cpu":
            return None
        return dest if dest.dtype == dtype else dest.view(dtype)

    def load(self, name: str, tensor: torch.Tensor, origin: str) -> int:
        """Map, pair, validate, convert and write (or stage) one incoming tensor.

        Args:
            name: any accepted spelling (native, HF, `save_pretrained`'s mix).
            tensor: the values; it may be reused by the caller once this returns, except for a half
                that waits for its partner (see `own_pending`).
            origin: where it came from (file, update bucket), for messages.

        Returns:
            How many resident slots this tensor completed.

        Raises:
            error_type: unknown name, bad shape/dtype/values, a tensor that arrived twice.
        """
        if tensor.requires_grad:  # a trainer's live parameter: copy its values, record nothing
            tensor = tensor.detach()
        if self.shard is not None:
            try:
                pieces = list(self.shard.pieces(name, tensor))
            except ConversionError as exc:
                raise self.error_type(f"{origin}: tensor {name}: {exc}") from None
            return sum(self._load_one(piece_name, piece, origin) for piece_name, piece in pieces)
        return self._load_one(name, tensor, origin)

    def _load_one(self, name: str, tensor: torch.Tensor, origin: str) -> int:
        """`load` of one tensor that needs no slicing."""
        route = self.routes.resolve(name)
        if route is None:
            raise self.error_type(f"{origin}: unexpected tensor {name!r} (no such weight in this model)")
        try:
            if route.kind == WEIGHT:
                return self._weight(route.slot, tensor, origin, name)
            if route.kind == SCALE:
                return self._scale(route.slot, tensor, origin, name)
            if route.kind == STACKED:
                return self._stacked(route, tensor, origin, name)
        except ConversionError as exc:
            raise self.error_type(f"{origin}: tensor {name} ({route.native}): {exc}") from None
        self.ignored.add(route.native)
        return 0

    def _weight(self, slot: Slot, t: torch.Tensor, origin: str, name: str) -> int:
        self._check_first(slot, name, origin, scale=False)
        if slot.kind == TABLE:
            if t.dtype not in INT_DTYPES:
                raise ConversionError(f"integer table expects int32/int64 values, got {t.dtype}")
            check_shape(t.shape, slot.logical, "table")
            if not self.dry_run:
                check_expert_table(t, slot.n_experts)
            self._put(slot.dest, t)
            return self._complete(slot, origin)
        if t.dtype in FLOAT_DTYPES:
            check_shape(t.shape, slot.logical, "weight" if slot.is_expert else "tensor")
            self._float_values(slot, t)
            return self._complete(slot, origin)
        if t.dtype in INT_DTYPES:
            raise ConversionError(f"expected floating values, got {t.dtype}")
        if t.dtype in _NATIVE_BYTES.get(slot.kind, ()):
            # The resident format's own bytes: written now, the scale may arrive later.
            check_shape(t.shape, slot.dest.shape, f"{slot.kind} weight")
            if slot.kind == FP8 and not self.dry_run:
                check_fp8_codes(t)
            pending = self._pending.get(slot)
            scale, owned = (None, False) if pending is None else self._native_scale(slot, pending.scale)
            self._put(slot.dest, t if t.dtype == slot.dest.dtype else t.view(slot.dest.dtype))
            if pending is None:
                self._awaiting_scale[slot] = origin
                return 0
            del self._pending[slot]
            self._put(slot.scale_dest, scale, owned=owned)
            return self._complete(slot, origin)
        if t.dtype == E4M3 or (t.dtype in PACKED_DTYPES and slot.is_expert):
            self._check_quantized_weight(slot, t)
            pending = self._pending.get(slot)
            if pending is not None:
                return self._convert_pair(slot, t, pending.scale, origin)
            self._pending[slot] = _Pending(weight=t, origin=origin)
            return 0
        if t.dtype in PACKED_DTYPES:
            raise ConversionError(f"{t.dtype} bytes (packed fp4) only feed routed experts; "
                                  f"this tensor takes float values, or fp8 with its .scale")
        raise ConversionError(f"unsupported weight dtype {t.dtype}")

    def _scale(self, slot: Slot, s: torch.Tensor, origin: str, name: str) -> int:
        self._check_first(slot, name, origin, scale=True)
        if slot.kind in (TABLE,) or (slot.kind == FLOAT and slot.dest.dim() != 2):
            raise ConversionError(f"{slot.native} takes no scale")
        if s.dtype not in FLOAT_DTYPES and s.dtype not in E8M0_DTYPES:
            raise ConversionError(f"a scale must be float values or ue8m0 bytes, got {s.dtype}")
        if not self.dry_run:  # what can be checked without its weight, checked now (one read)
            if s.dtype in FLOAT_DTYPES:
                check_finite(s)
            else:
                s = e8m0_bytes(s)  # its bytes as uint8, what every use of them takes
        if slot in self._awaiting_scale:
            scale, owned = self._native_scale(slot, s)
            del self._awaiting_scale[slot]
            self._put(slot.scale_dest, scale, owned=owned)
            return self._complete(slot, origin)
        pending = self._pending.get(slot)
        if pending is not None:
            return self._convert_pair(slot, pending.weight, s, origin)
        self._pending[slot] = _Pending(scale=s, origin=origin)
        return 0

    def _stacked(self, route: Route, t: torch.Tensor, origin: str, name: str) -> int:
        """HF's stacked experts: every expert's matrix goes the way a per-expert float tensor goes."""
        try:
            parts = split_stacked(name, t, tuple(stack.w for stack in route.stacks))
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
        if t.dtype not in FLOAT_DTYPES:
            raise ConversionError(f"stacked experts carry float values, got {t.dtype}")
        for stack, part in zip(route.stacks, parts, strict=True):
            check_shape(part.shape, stack.logical, f"stacked {stack.w}")
            for slot in stack.slots:
                self._check_first(slot, name, origin, scale=False)
        for stack, part in zip(route.stacks, parts, strict=True):
            for slot in stack.slots:
                self._float_values(slot, part[slot.expert])
                self._complete(slot, origin)
        return sum(len(stack.slots) for stack in route.stacks)

    # ---- conversions ----
    def _float_values(self, slot: Slot, values: torch.Tensor) -> None:
        """Float values (shape already checked) into a float, dense-expert or quantized slot."""
        if self.dry_run:
            return
        if slot.kind in (FLOAT, DENSE):
            if self.staged:  # checked as it is staged: the staging buffer is not live (one read of the values)
                buffer, raw = self._staging_buffer(slot.dest)
                copy_finite_into(buffer, values, stream=True)
                self._staging.append((slot.dest, buffer, raw))
                return
            self._before_writing()
            if _in_place(slot.dest, values):  # read straight into its destination (`destination`)
                check_finite(values)
                return
            # Fresh loads and fail-stop updates check the values inside the copy that writes them (one read):
            # nothing reads a fresh model, and a failed fail-stop update stops serving whatever it wrote.
            # A fresh load's fresh pages are zeroed as they are first written, and streaming into them measured
            # slower (the small and medium benchmark loads, 5-40%): the size rule. An update's weights are
            # not read before it ends: streamed, as staging is.
            copy_finite_into(slot.dest, values, stream=None if self.fresh else True)
            return
        weight, scale = quantize_expert(values, slot.kind, self.layout)
        self._put(slot.dest, weight, owned=True)
        self._put(slot.scale_dest, scale, owned=True)

    def _native_scale(self, slot: Slot, s: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(resident value, whether it is a new tensor of ours) of the scale of a weight written in its
        resident format (its values were checked at arrival); no value in a dry run. Writes nothing."""
        if slot.kind == FP4:
            if s.dtype not in E8M0_DTYPES:
                raise ConversionError(f"ue8m0 scale must be float8_e8m0fnu or uint8 bytes, got {s.dtype}")
            check_shape(s.shape, slot.scale_dest.shape, "fp4 scale")
            return (s if s.dtype == torch.uint8 else s.view(torch.uint8)), False
        check_shape(s.shape, slot.scale_dest.shape, "fp8 scale")
        if self.dry_run:
            return None, False
        return fp8_scale_values(s), s.dtype not in FLOAT_DTYPES  # e8m0 bytes are decoded into a new tensor

    def _check_quantized_weight(self, slot: Slot, t: torch.Tensor) -> None:
        """Shape of FP8 / FP4 bytes that must be converted (they need their scale first)."""
        if slot.kind == FLOAT and slot.dest.dim() != 2:
            raise ConversionError(f"a {t.dtype} tensor cannot feed a {slot.dest.dim()}-D parameter")
        out_dim, in_dim = slot.logical
        if t.dtype == E4M3:
            check_shape(t.shape, (out_dim, in_dim), "fp8 weight")
        else:
            check_shape(t.shape, (out_dim, in_dim // 2), "packed fp4 weight")

    def _convert_pair(self, slot: Slot, weight: torch.Tensor, scale: torch.Tensor, origin: str) -> int:
        """Both halves of a weight that is not in its resident format: dequantize, then store as resident."""
        out_dim, in_dim = slot.logical
        if weight.dtype == E4M3:
            grid = fp8_scale_grid_shape((out_dim, in_dim), self.layout.fp8_block)
        else:
            grid = (out_dim, in_dim // self.layout.fp4_group)
        check_shape(scale.shape, grid, f"{'fp8' if weight.dtype == E4M3 else 'fp4'} scale")
        del self._pending[slot]
        if not self.dry_run:
            if slot.kind in (FLOAT, DENSE):
                # Straight into the destination (or its staging buffer): every check passes before the first write.
                # a fresh weight or a staging buffer is not read before the update ends: codes checked as written
                self._fill(slot.dest, lambda out: dequantize(weight, scale, self.layout, slot.logical, out.dtype, out,
                                                             check_as_written=self.fresh or self.staged))
            else:
                values = dequantize(weight, scale, self.layout, slot.logical, torch.float32)
                q, q_scale = quantize_expert(values, slot.kind, self.layout)
                self._put(slot.dest, q, owned=True)
                self._put(slot.scale_dest, q_scale, owned=True)
        return self._complete(slot, origin)

    # ---- writing ----
    def _put(self, dest: torch.Tensor, value: torch.Tensor, owned: bool = False) -> None:
        """Write `value` into `dest` in place, or stage it. `owned`: a fresh tensor of ours (a conversion's
        result), which staging may keep without copying."""
        if self.dry_run:
            return
        if self.staged:
            raw = None
            if not owned:
                buffer, raw = self._staging_buffer(dest)
                copy_into(buffer, value)
                value = buffer
            self._staging.append((dest, value, raw))
            return
        self._write(dest, value)

    def _fill(self, dest: torch.Tensor, produce: Callable[[torch.Tensor], object]) -> None:
        """Like `_put`, for a value that `produce(out)` validates and then writes into `out` itself."""
        if self.dry_run:
            return
        if self.staged:
            buffer, raw = self._staging_buffer(dest)
            produce(buffer)
            self._staging.append((dest, buffer, raw))
            return
        self._before_writing()
        produce(dest)

    def _staging_buffer(self, dest: torch.Tensor) -> tuple[torch.Tensor, RawCopy | None]:
        return self._staging_buffers.buffer(dest)

    def _before_writing(self) -> None:
        if not self.wrote:
            self.wrote = True
            if self._before_first_write is not None:
                self._before_first_write()

    def _write(self, dest: torch.Tensor, value: torch.Tensor) -> None:
        self._before_writing()
        if not _in_place(dest, value):
            copy_into(dest, value)

    def commit(self) -> None:
        """Apply the staged values (atomic refits): one copy per tensor into its resident storage. Staging
        buffers laid out like their destinations are copied as raw bytes, all in one call with streaming
        stores (nothing reads the weights before the update ends; a copy call per tensor cost more than the
        copies of the small ones); the others (conversion results, other devices) tensor by tensor."""
        raw = [copy for _, _, copy in self._staging if copy is not None]
        copied_raw = bool(raw) and self._write_raw(raw)
        for dest, value, copy in self._staging:
            if copy is None or not copied_raw:
                self._write(dest, value)
        self._release_staging()

    def _write_raw(self, copies: list[RawCopy]) -> bool:
        """Raw copies into resident storage, in one call; False where no kernel runs (nothing written)."""
        self._before_writing()
        return copy_bytes_streamed(copies)

    def discard(self) -> None:
        """Drop the staged values and anything waiting for a partner."""
        self._release_staging()
        self._pending.clear()
        if self.shard is not None:
            self.shard.discard()

    def _release_staging(self) -> None:
        self._staging.clear()

    def own_pending(self) -> None:
        """Copy the halves still waiting for their partner out of the caller's buffers (a trainer reuses
        its receive buffer for the next bucket). Only these few are ever copied."""
        for pending in self._pending.values():
            if not pending.owned:
                pending.weight = None if pending.weight is None else pending.weight.clone()
                pending.scale = None if pending.scale is None else pending.scale.clone()
                pending.owned = True
        if self.shard is not None:
            self.shard.own_pending()

    # ---- accounting ----
    def _check_first(self, slot: Slot, name: str, origin: str, *, scale: bool) -> None:
        first = self._completed.get(slot)
        if first is not None and scale:
            raise self.error_type(f"{origin}: tensor {name!r}: {slot.native} is already complete (from {first}), "
                                  f"no weight waits for this scale")
        if first is None:
            if scale:
                pending = self._pending.get(slot)
                first = pending.origin if pending is not None and pending.scale is not None else None
            else:
                first = self._awaiting_scale.get(slot)
                pending = self._pending.get(slot)
                if first is None and pending is not None and pending.weight is not None:
                    first = pending.origin
        if first is not None:
            raise self.error_type(f"{origin}: tensor {name!r} ({slot.native}) arrived twice (first from {first})")

    def _complete(self, slot: Slot, origin: str) -> int:
        self._completed[slot] = origin
        self.written.add(slot.native)
        return 1

    def unpaired(self) -> list[str]:
        """Weights still waiting for their scale, and scales without their weight, as messages."""
        out = [(slot.native, f"{slot.native} (from {origin}) has no scale")
               for slot, origin in self._awaiting_scale.items()]
        for slot, pending in self._pending.items():
            missing = "scale" if pending.scale is None else "weight"
            out.append((slot.native, f"{slot.native} (from {pending.origin}) has no {missing}"))
        shard = [] if self.shard is None else self.shard.unpaired()
        return [message for _, message in sorted(out)] + shard

    def check_complete(self, expected: set[str], what: str) -> None:
        """Raise unless every expected weight was written and no weight waits for its scale partner."""
        problems = self.unpaired()
        missing = sorted(expected - self.written)
        if missing:
            shown = ", ".join(missing[:10]) + (f" ... (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            problems.append(f"{len(missing)} missing tensor(s): {shown}")
        if problems:
            raise self.error_type(f"{what}: " + "; ".join(problems))


def _in_place(dest: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `value` is `dest`'s own bytes already (read straight into it: `WeightWriter.destination`)."""
    return value is dest or (value.data_ptr() == dest.data_ptr() and value.dtype == dest.dtype
                             and value.shape == dest.shape and value.stride() == dest.stride())
