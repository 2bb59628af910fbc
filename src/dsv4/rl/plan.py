"""The plan of one weight update: which tensors travel, in which packed bucket, at which byte offset.

A trainer packs its tensors into flat byte buckets (few large transfers instead of one per tensor, the
lesson every RL stack learned: slime's sync went from 120 s to 7 s largely by flattening buckets). The
plan is plain JSON, the metadata a trainer hands to the engine directly or through the server's admin
route, and both ends build their views from it:

    {"protocol": "dsv4-weight-sync/1", "update_id": "9f2c...", "base_version": 3, "bucket_bytes": 268435456,
     "alignment": 64, "buckets": [{"nbytes": 1310784, "checksum": "xxh3-64:0d5e...",
                                   "tensors": [{"name": "model.embed_tokens.weight", "dtype": "bfloat16",
                                                "shape": [49, 128], "offset": 0}, ...]}, ...]}

Names may be HF or native (the engine's refit session maps both); dtypes are those `DTYPES` lists. Tensors
are placed in the order given, each at an offset aligned to `alignment` bytes; a bucket closes when the
next tensor would overflow `bucket_bytes`, and a tensor larger than that gets a bucket of its own. Padding
bytes are zero and covered by the bucket's checksum. `base_version` is the engine weights version the
update applies to (None: any); the engine refuses any other before receiving a byte.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from dsv4.errors import WeightUpdateError
from dsv4.rl.checksum import BucketHasher, is_checksum, text_checksum

PROTOCOL = "dsv4-weight-sync/1"
# Tensor offsets inside a bucket are multiples of this: every dtype's alignment (at most 8 bytes) and a
# cache line, so the engine's views are valid for `view(dtype)` and its copies out of them run at full speed.
ALIGNMENT = 64
# Bucket sizes by transport. Over gloo on a CPU host small buckets win: the trainer packs one while the
# previous is on the wire and both stay in cache (benchmarks/bench_weight_sync.py, a 295 MiB update on the
# 2-core development VM, contended: transport 0.5 s with 4 MiB buckets, 1.1 s with 16, 1.5-2.2 s with 256).
# On GPUs a collective call costs tens of microseconds, so NCCL takes verl's 512 MiB default (two buffers at
# each end; not measured here). Shared memory has no transport: its buckets only structure the segment.
GLOO_BUCKET_BYTES = 4 << 20
NCCL_BUCKET_BYTES = 512 << 20
DEFAULT_BUCKET_BYTES = GLOO_BUCKET_BYTES
# The dtypes a tensor may travel in: floats (quantized on the fly by the engine when its experts are FP8
# or FP4), FP8 e4m3 weights and their ue8m0 scales, packed FP4 bytes, integer tables (tid2eid).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Update ids name keys in the transfer group's store: plain letters and digits (plan() uses a uuid4 hex).
_UPDATE_ID = re.compile(r"[A-Za-z0-9]{1,64}")
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPES[self.dtype].itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BucketEntry:
    """One packed buffer: its size, its checksum and the tensors it holds."""

    nbytes: int
    checksum: str
    tensors: tuple[TensorEntry, ...]


@dataclass(frozen=True)
class WeightSyncPlan:
    """The metadata of one update (see the module docstring for its JSON form)."""

    update_id: str
    base_version: int | None
    bucket_bytes: int
    buckets: tuple[BucketEntry, ...]
    protocol: str = PROTOCOL
    alignment: int = ALIGNMENT

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    @property
    def buffer_bytes(self) -> int:
        """Size of the receive buffers: the largest bucket."""
        return max((b.nbytes for b in self.buckets), default=0)

    def to_json(self) -> dict:
        return {
            "protocol": self.protocol,
            "update_id": self.update_id,
            "base_version": self.base_version,
            "bucket_bytes": self.bucket_bytes,
            "alignment": self.alignment,
            "buckets": [
                {"nbytes": b.nbytes, "checksum": b.checksum,
                 "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset}
                             for t in b.tensors]}
                for b in self.buckets
            ],
        }

    def digest(self) -> str:
        """Checksum of the plan's canonical JSON: both ends compare it before any byte moves."""
        return text_checksum(json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")))

    @classmethod
    def from_json(cls, meta: object) -> WeightSyncPlan:
        """Parse and validate metadata (as produced by `to_json`, possibly after a JSON round trip).

        Raises:
            WeightUpdateError: naming the field and the bad value, for anything malformed: unknown protocol,
                wrong types, unknown dtype, offsets unaligned, overlapping or outside their bucket, a bucket
                size that disagrees with its tensors, a malformed checksum, a name listed twice.
        """
        return _parse_plan(meta)


# ---- building a plan (trainer side) ----
def plan_buckets(
    named_tensors: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES, base_version: int | None = None
) -> WeightSyncPlan:
    """Lay the tensors out in buckets and checksum each bucket's bytes (one read pass over the tensors).

    Args:
        named_tensors: (name, tensor) pairs or a mapping, e.g. a transformers model's `state_dict()`. It is
            read once here; whoever then sends must pass the same tensors again (a mapping, or a fresh
            iterable: a spent generator sends nothing and is refused as not matching the plan).
        bucket_bytes: the largest bucket, except that a tensor larger than this travels alone.
        base_version: the engine weights version this update applies to (None: whatever it is).

    Returns:
        The plan; `to_json()` gives the metadata for the engine.

    Raises:
        WeightUpdateError: a non-tensor value, an unsupported dtype, a name given twice, bad arguments.
    """
    if not _is_int(bucket_bytes) or bucket_bytes < 1:
        raise WeightUpdateError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if base_version is not None and (not _is_int(base_version) or base_version < 0):
        raise WeightUpdateError(f"base_version must be None or an int >= 0, got {base_version!r}")
    buckets: list[BucketEntry] = []
    entries: list[TensorEntry] = []
    hasher = BucketHasher()
    end = 0
    seen: set[str] = set()
    for name, tensor in _checked_pairs(named_tensors):
        if name in seen:
            raise WeightUpdateError(f"tensor {name!r} is listed twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        offset = _aligned(end)
        if entries and offset + nbytes > bucket_bytes:
            buckets.append(BucketEntry(end, hasher.hexdigest(), tuple(entries)))
            entries, hasher, end, offset = [], BucketHasher(), 0, 0
        hasher.update_zeros(offset - end)
        hasher.update(flat_bytes(tensor))
        entries.append(TensorEntry(name, _DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset))
        end = offset + nbytes
    if entries:
        buckets.append(BucketEntry(end, hasher.hexdigest(), tuple(entries)))
    return WeightSyncPlan(uuid.uuid4().hex, base_version, bucket_bytes, tuple(buckets))


def pack_bucket(bucket: BucketEntry, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy a bucket's tensors into `out` (a flat uint8 buffer of at least bucket.nbytes), padding zeroed.

    Returns:
        The view of `out` holding exactly the bucket.
    """
    packed = out[: bucket.nbytes]
    end = 0
    for entry in bucket.tensors:
        packed[end : entry.offset].zero_()
        packed[entry.offset : entry.end].copy_(flat_bytes(tensors[entry.name]))
        end = entry.end
    return packed


def bucket_views(bucket: BucketEntry, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket buffer: no copy."""
    for entry in bucket.tensors:
        raw = buffer[entry.offset : entry.end]
        yield entry.name, raw.view(DTYPES[entry.dtype]).view(entry.shape)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (row-major; a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def check_tensors_match(plan: WeightSyncPlan, named_tensors: NamedTensors) -> dict[str, torch.Tensor]:
    """The tensors to send, by name, checked against the plan (same names, dtypes and shapes).

    Raises:
        WeightUpdateError: a planned tensor missing, an extra one, or one whose dtype or shape changed.
    """
    tensors = dict(_checked_pairs(named_tensors))
    planned = {t.name: t for b in plan.buckets for t in b.tensors}
    missing = sorted(planned.keys() - tensors.keys())
    extra = sorted(tensors.keys() - planned.keys())
    if missing or extra:
        raise WeightUpdateError(
            f"update {plan.update_id}: the tensors differ from the plan's: missing {missing[:5]}, "
            f"not planned {extra[:5]}"
        )
    for name, entry in planned.items():
        t = tensors[name]
        if _DTYPE_NAMES[t.dtype] != entry.dtype or tuple(t.shape) != entry.shape:
            raise WeightUpdateError(
                f"update {plan.update_id}: tensor {name!r} is {_DTYPE_NAMES[t.dtype]} {list(t.shape)}, "
                f"the plan says {entry.dtype} {list(entry.shape)}"
            )
    return tensors


def _checked_pairs(named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise WeightUpdateError(f"named_tensors must yield (name, tensor) pairs, got {type(pair).__name__}")
        name, tensor = pair
        if not isinstance(name, str) or not name:
            raise WeightUpdateError(f"tensor name must be a non-empty str, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _DTYPE_NAMES:
            supported = ", ".join(DTYPES)
            raise WeightUpdateError(f"tensor {name!r}: dtype {tensor.dtype} cannot travel (supported: {supported})")
        yield name, tensor


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- parsing (engine side) ----
def _field(obj: Mapping, key: str, kind, where: str):
    if key not in obj:
        raise WeightUpdateError(f"weight update metadata: {where}: missing field {key!r}")
    value = obj[key]
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise WeightUpdateError(f"weight update metadata: {where}.{key}: expected {kind.__name__}, got {value!r:.80}")
    return value


def _parse_plan(meta: object) -> WeightSyncPlan:
    if not isinstance(meta, Mapping):
        raise WeightUpdateError(f"weight update metadata: expected a JSON object, got {type(meta).__name__}")
    protocol = _field(meta, "protocol", str, "plan")
    if protocol != PROTOCOL:
        raise WeightUpdateError(f"weight update metadata: protocol {protocol!r} is not {PROTOCOL!r}")
    update_id = _field(meta, "update_id", str, "plan")
    if not _UPDATE_ID.fullmatch(update_id):
        raise WeightUpdateError(
            f"weight update metadata: update_id must be 1-64 letters or digits, got {update_id!r:.80}"
        )
    base_version = meta.get("base_version")
    if base_version is not None and (not _is_int(base_version) or base_version < 0):
        raise WeightUpdateError(
            f"weight update metadata: base_version must be null or an int >= 0, got {base_version!r}"
        )
    bucket_bytes = _field(meta, "bucket_bytes", int, "plan")
    alignment = _field(meta, "alignment", int, "plan")
    if bucket_bytes < 1 or alignment != ALIGNMENT:
        raise WeightUpdateError(
            f"weight update metadata: bucket_bytes {bucket_bytes} must be >= 1 and alignment {alignment} == {ALIGNMENT}"
        )
    buckets = []
    seen: set[str] = set()
    for i, raw_bucket in enumerate(_field(meta, "buckets", list, "plan")):
        where = f"buckets[{i}]"
        if not isinstance(raw_bucket, Mapping):
            raise WeightUpdateError(f"weight update metadata: {where}: expected an object")
        nbytes = _field(raw_bucket, "nbytes", int, where)
        checksum = _field(raw_bucket, "checksum", str, where)
        if not is_checksum(checksum):
            raise WeightUpdateError(f"weight update metadata: {where}.checksum: malformed {checksum!r:.80}")
        entries = []
        end = 0
        for j, raw in enumerate(_field(raw_bucket, "tensors", list, where)):
            entry = _parse_tensor(raw, f"{where}.tensors[{j}]", end)
            if entry.name in seen:
                raise WeightUpdateError(f"weight update metadata: tensor {entry.name!r} is listed twice")
            seen.add(entry.name)
            entries.append(entry)
            end = entry.end
        if not entries or nbytes != end:
            raise WeightUpdateError(
                f"weight update metadata: {where}: nbytes {nbytes} != end of its last tensor {end}"
                + ("" if entries else " (an empty bucket)")
            )
        if len(entries) > 1 and nbytes > bucket_bytes:
            raise WeightUpdateError(f"weight update metadata: {where}: {nbytes} bytes over bucket_bytes {bucket_bytes}")
        buckets.append(BucketEntry(nbytes, checksum, tuple(entries)))
    return WeightSyncPlan(update_id, base_version, bucket_bytes, tuple(buckets), protocol, alignment)


def _parse_tensor(raw: object, where: str, previous_end: int) -> TensorEntry:
    if not isinstance(raw, Mapping):
        raise WeightUpdateError(f"weight update metadata: {where}: expected an object")
    name = _field(raw, "name", str, where)
    dtype = _field(raw, "dtype", str, where)
    if dtype not in DTYPES:
        raise WeightUpdateError(f"weight update metadata: {where} ({name}): dtype {dtype!r} not in {list(DTYPES)}")
    shape = _field(raw, "shape", list, where)
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise WeightUpdateError(f"weight update metadata: {where} ({name}): bad shape {shape!r:.80}")
    offset = _field(raw, "offset", int, where)
    if offset % ALIGNMENT or offset < previous_end:
        raise WeightUpdateError(
            f"weight update metadata: {where} ({name}): offset {offset} is unaligned or overlaps the previous "
            f"tensor (ends at {previous_end})"
        )
    return TensorEntry(name, dtype, tuple(shape), offset)
