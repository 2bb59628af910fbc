"""Checkpoint validation without tensor data (`dsv4 inspect`): would this directory load, and what is in it?

The models are built on the meta device (shapes, no memory) and every tensor the safetensors headers
declare goes, as a meta tensor of the declared shape and dtype, through the same `WeightWriter.stage` a
load uses: the same name mapping, weight/scale pairing, drafter filtering, shape and dtype checks, in the
load's own words. Only the checks that need values (finiteness, NaN codes, expert-id tables) are left to
the load. So "loadable: yes" here means a load can fail only on a tensor's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4.config import DENSE, ModelConfig
from dsv4.errors import CheckpointError
from dsv4.weights.checkpoint import DTYPE_BYTES, TORCH_DTYPES, CheckpointDir
from dsv4.weights.loader import DRAFTERS, LoadedModels, build_models, quant_layout, resolve_expert_format
from dsv4.weights.names import canonical_name, canonical_tensors
from dsv4.weights.writer import WeightWriter

NATIVE_FORMAT, HF_FORMAT, MIXED_FORMAT = "native", "hf", "transformers-saved (HF prefixes, native suffixes)"
HF_PREFIX = "model."
HF_HEAD = "lm_head.weight"
DRAFTER_PREFIX = "mtp."
SCALE_SUFFIX = ".scale"
# FP4 experts store two e2m1 codes per byte, so a packed byte counts as two parameters.
PACKED_DTYPES = ("I8", "U8")
VALUES_PER_PACKED_BYTE = 2
# Resident dtype of the meta models: it decides nothing a header can get wrong (floats convert to it).
_META_DTYPE = torch.float32


@dataclass
class CheckpointInspection:
    """What `inspect_checkpoint` found. Every list holds the messages a load would raise.

    Attributes:
        path: the checkpoint directory.
        format: NATIVE_FORMAT, HF_FORMAT or MIXED_FORMAT, from the tensor names.
        files: number of safetensors files.
        tensors: number of tensors in the files.
        bytes: total tensor bytes.
        dtypes: per safetensors dtype, {"tensors": count, "bytes": size}.
        parameters: logical parameters (scales excluded, a packed FP4 byte counted as two).
        expert_dtype: the routed experts' format as stored (config.json).
        drafter: the drafter checked along with the target ("mtp" / "dspark"), or None.
        rejected: one message per tensor the load would refuse (unknown name, shape, dtype).
        missing: resident tensors no tensor in the files claims (a rejected or unpaired one is listed there,
            not here).
        unpaired: quantized weights without their scale, or scales without their weight.
        ignored: tensors a load skips (drafter copies of the target's embedding/head, unrequested drafters).
    """

    path: Path
    format: str
    files: int
    tensors: int
    bytes: int
    dtypes: dict[str, dict[str, int]]
    parameters: int
    expert_dtype: str
    drafter: str | None
    rejected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unpaired: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def loadable(self) -> bool:
        return not (self.rejected or self.missing or self.unpaired)

    def to_json(self) -> dict:
        """The inspection as plain JSON-able values."""
        return {
            "path": str(self.path), "format": self.format, "files": self.files, "tensors": self.tensors,
            "bytes": self.bytes, "dtypes": self.dtypes, "parameters": self.parameters,
            "expert_dtype": self.expert_dtype, "drafter": self.drafter, "rejected": self.rejected,
            "missing": self.missing, "unpaired": self.unpaired, "ignored": self.ignored,
            "loadable": self.loadable,
        }


def inspect_checkpoint(
    path: str | Path, cfg: ModelConfig | None = None, draft: str | None = None
) -> CheckpointInspection:
    """Check that a checkpoint directory would load, from config.json and the safetensors headers only.

    Args:
        path: the checkpoint directory.
        cfg: its config, if already parsed.
        draft: the drafter to check the `mtp.*` tensors against ("mtp" / "dspark"); None: the drafter the
            checkpoint carries (`drafter_in`), if any.

    Returns:
        The inspection; `loadable` tells whether a load would pass every check that needs no data.

    Raises:
        ConfigError: config.json is missing or invalid.
        CheckpointError: the directory has no safetensors files, or a header is corrupt.
    """
    path = Path(path)
    cfg = cfg if cfg is not None else ModelConfig.from_file(path)
    checkpoint = CheckpointDir(path)
    draft = draft if draft is not None else drafter_in(cfg, checkpoint)
    if draft == "dspark":
        cfg = cfg.with_checkpoint_names(checkpoint.tensors)  # DSpark's stage count: its mtp.{s} names
    expert_format = resolve_expert_format(cfg, None)
    models = build_models(cfg, expert_format, _META_DTYPE, "meta", draft)
    loaded = LoadedModels(cfg, models, quant_layout(cfg), expert_format, load_format="safetensors")
    table = loaded.slot_table()
    # A dry run: the load's own mapping, pairing and shape/dtype checks on meta tensors, nothing written.
    writer = WeightWriter(loaded.routes(), loaded.layout, error_type=CheckpointError, dry_run=True)
    rejected: list[str] = []
    present: set[str] = set()  # native weight names some tensor in the files claims (scales aside)
    for name, info in checkpoint.tensors.items():
        tensor = torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype], device="meta")
        try:
            writer.load(name, tensor, str(info.file))
            natives = [native for native, _ in canonical_tensors(name, tensor)]
        except CheckpointError as exc:
            rejected.append(str(exc))  # reported once, as rejected, not again as missing
            natives = [canonical_name(name)]
        present.update(n for n in natives if not n.endswith(SCALE_SUFFIX))
    dtypes: dict[str, dict[str, int]] = {}
    for info in checkpoint.tensors.values():
        entry = dtypes.setdefault(info.dtype, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += _numel(info.shape) * DTYPE_BYTES[info.dtype]
    return CheckpointInspection(
        path=checkpoint.path,
        format=detect_format(list(checkpoint.tensors)),
        files=len(checkpoint.files),
        tensors=len(checkpoint.tensors),
        bytes=sum(e["bytes"] for e in dtypes.values()),
        dtypes=dict(sorted(dtypes.items())),
        parameters=parameter_count(checkpoint),
        expert_dtype=cfg.quant.expert_dtype if cfg.quant else DENSE,
        drafter=draft,
        rejected=rejected,
        missing=sorted(table.names() - present),
        unpaired=writer.unpaired(),
        ignored=sorted(writer.ignored),
    )


def drafter_in(cfg: ModelConfig, checkpoint: CheckpointDir) -> str | None:
    """Which drafter a checkpoint carries, from its names (`mtp.*`) and config (`dspark_*`); None if none."""
    if not any(canonical_name(n).startswith(DRAFTER_PREFIX) for n in checkpoint.tensors):
        return None
    mtp, dspark = DRAFTERS
    return dspark if cfg.dspark is not None else mtp


def detect_format(names: Sequence[str]) -> str:
    """The naming dialect of a checkpoint.

    Returns:
        NATIVE_FORMAT when no name has the `model.` prefix; HF_FORMAT when every non-drafter name has it and
        layer names are spelled as transformers defines them; otherwise MIXED_FORMAT, what transformers'
        save_pretrained writes (HF prefixes on native suffixes, and an unprefixed `head.weight`).
    """
    own = [n for n in names if not n.startswith(DRAFTER_PREFIX)]
    prefixed = [n for n in own if n.startswith(HF_PREFIX) or n == HF_HEAD]
    if not prefixed:
        return NATIVE_FORMAT
    native_suffix_layers = [
        n for n in prefixed if n.startswith(f"{HF_PREFIX}layers.") and canonical_name(n) == n[len(HF_PREFIX):]
    ]
    if len(prefixed) == len(own) and not native_suffix_layers:
        return HF_FORMAT
    return MIXED_FORMAT


def parameter_count(checkpoint: CheckpointDir) -> int:
    """Logical parameters: scales excluded, packed FP4 bytes counted as two values each."""
    canonical = {name: canonical_name(name) for name in checkpoint.tensors}
    scaled = {c[: -len(SCALE_SUFFIX)] for c in canonical.values() if c.endswith(SCALE_SUFFIX)}
    total = 0
    for name, info in checkpoint.tensors.items():
        native = canonical[name]
        if native.endswith(SCALE_SUFFIX):
            continue
        packed = info.dtype in PACKED_DTYPES and native.removesuffix(".weight") in scaled
        total += _numel(info.shape) * (VALUES_PER_PACKED_BYTE if packed else 1)
    return total


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel
