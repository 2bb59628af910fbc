"""Resident weights out: (native name, tensor) pairs, and checkpoint directories.

`iter_weights` yields the resident bytes themselves under native names, in the form the loader reads
back without conversion (FP4 experts as packed int8 + e8m0 scale, FP8 experts as e4m3 + fp32 scale,
dense tensors in their resident dtype, tid2eid int32). Loading those pairs into another engine with the
same config therefore makes it bit-identical: `other.update_weights(llm.iter_weights())`.

`save_checkpoint` writes a directory `LLM` / `load_models` load back (`dsv4 convert`): native layout
(DeepSeek release names, optional FP8 dense linears, experts in any format) or HF layout (transformers'
names, experts stacked `gate_up_proj` / `down_proj` in float). Its config.json declares exactly what was
written: a quantization_config only when something is quantized, and the dense dtype as torch_dtype.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4.config import DENSE, FP4, FP8, QuantConfig
from dsv4.errors import ConfigError
from dsv4.model.moe import RoutedExperts
from dsv4.progress import track
from dsv4.quant import quantize_fp4, quantize_fp8_blockwise
from dsv4.weights.checkpoint import INDEX_FILE
from dsv4.weights.loader import TARGET, LoadedModels
from dsv4.weights.names import to_hf_name

NATIVE, HF = "native", "hf"
LAYOUTS = (NATIVE, HF)
DENSE_MODEL, DENSE_FP8 = "model", "fp8"
DENSE_EXPORTS = (DENSE_MODEL, DENSE_FP8)
RESIDENT = "resident"
EXPERT_EXPORTS = (RESIDENT, FP4, FP8, DENSE)

# The dense linears DeepSeek's releases store as block FP8 (main model, MTP layers, DSpark's main_proj); every other
# float tensor (embeddings, norms, routers, compressors, mHC, sinks) stays unquantized.
FP8_LINEAR = re.compile(
    r"^(layers|mtp)\.\d+\."
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj|main_proj)\.weight$"
)
SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"
HF_GATE_UP, HF_DOWN = "gate_up_proj", "down_proj"
# transformers keeps the hash-routing table as int64; native checkpoints store int32.
HF_TABLE_DTYPE = torch.int64
# Files of a checkpoint directory that are not weights but belong with them.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # the usual Hugging Face shard size
_SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses files without it
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def scale_name(weight_name: str) -> str:
    """`...w1.weight` -> `...w1.scale` (native spelling)."""
    return weight_name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX


def _e8m0(raw: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes as the dtype the releases store (safetensors F8_E8M0): a view, never a numeric cast."""
    return raw.view(torch.float8_e8m0fnu)


# ---- iter_weights ----
def iter_weights(loaded: LoadedModels) -> Iterator[tuple[str, torch.Tensor]]:
    """Every loadable tensor of every model as (native name, tensor), a weight directly followed by its
    scale. The tensors are views of the resident storage: clone them to keep them past an update."""
    table = loaded.slot_table()
    for slot in table:
        param = table.param(slot).detach()
        if not slot.is_expert:
            yield slot.native, param
            continue
        yield slot.native, param[slot.expert]
        fmt = table.expert_format(slot)
        if fmt != DENSE:
            scale = table.scale_param(slot).detach()[slot.expert]
            yield scale_name(slot.native), _e8m0(scale) if fmt == FP4 else scale


# ---- save_checkpoint ----
@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one export writes, resolved from the options and the resident formats."""

    layout: str
    dense_fp8: bool
    experts: str  # format written: fp4 | fp8 | dense
    resident_experts: str
    block: tuple[int, int]
    group: int
    scale_fmt: str

    @property
    def quantized(self) -> bool:
        return self.dense_fp8 or self.experts != DENSE


def _plan(loaded: LoadedModels, layout: str, dense: str, experts: str) -> _Plan:
    options = (("layout", layout, LAYOUTS), ("dense", dense, DENSE_EXPORTS), ("experts", experts, EXPERT_EXPORTS))
    for option, value, allowed in options:
        if value not in allowed:
            raise ConfigError(f"save_checkpoint: {option} must be one of {allowed}, got {value!r}")
    written = loaded.expert_format if experts == RESIDENT else experts
    if layout == HF:
        if dense != DENSE_MODEL or experts in (FP4, FP8):
            raise ConfigError(
                "save_checkpoint: the HF layout stores every tensor in float (experts stacked as gate_up_proj / "
                "down_proj); use layout='native' for FP8 dense linears or FP4/FP8 experts"
            )
        written = DENSE
    if dense == DENSE_FP8 and written == DENSE:
        raise ConfigError(
            "save_checkpoint: dense='fp8' needs quantized experts (experts='fp4' or 'fp8'): a quantization_config "
            "always declares the experts' format, so dense experts would be re-quantized at load"
        )
    lay = loaded.layout
    return _Plan(layout, dense == DENSE_FP8, written, loaded.expert_format, lay.fp8_block, lay.fp4_group, lay.scale_fmt)


def _quantize_fp8(values: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_fp8_blockwise(values.float(), plan.block, plan.scale_fmt)
    return q, _e8m0(scale) if scale.dtype == torch.uint8 else scale


def _plain_tensors(native: str, param: torch.Tensor, plan: _Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """One non-expert tensor under the layout's name (FP8 linears as weight + scale when asked)."""
    if plan.layout == HF:
        if not param.is_floating_point():
            param = param.to(HF_TABLE_DTYPE)
        yield to_hf_name(native), param
    elif plan.dense_fp8 and FP8_LINEAR.match(native):
        q, scale = _quantize_fp8(param, plan)
        yield native, q
        yield scale_name(native), scale
    else:
        yield native, param


def _expert_tensors(
    experts: RoutedExperts, w: str, e: int, native: str, plan: _Plan
) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert e's matrix `w` in the written format: resident bytes when the format is unchanged, else
    the values the model computes with (`expert_weight`), re-quantized by dsv4's quantizers."""
    if plan.experts == plan.resident_experts:
        weight = getattr(experts, w).detach()[e]
        yield native, weight
        if plan.experts != DENSE:
            scale = getattr(experts, f"{w}_scale").detach()[e]
            yield scale_name(native), _e8m0(scale) if plan.experts == FP4 else scale
        return
    values = experts.expert_weight(w, e)
    if plan.experts == DENSE:
        yield native, values
    elif plan.experts == FP8:
        q, scale = _quantize_fp8(values, plan)
        yield native, q
        yield scale_name(native), scale
    else:
        packed, scale = quantize_fp4(values.float(), plan.group)
        yield native, packed.view(torch.int8)
        yield scale_name(native), _e8m0(scale)


def _hf_stacked_experts(experts: RoutedExperts, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' layout: gate_up_proj [E, 2I, D] (gate rows first) and down_proj [E, D, I], float."""
    count = experts.num_experts
    gate_up = torch.stack(
        [torch.cat((experts.expert_weight("w1", e), experts.expert_weight("w3", e))) for e in range(count)]
    )
    down = torch.stack([experts.expert_weight("w2", e) for e in range(count)])
    yield to_hf_name(f"{prefix}.{HF_GATE_UP}"), gate_up
    yield to_hf_name(f"{prefix}.{HF_DOWN}"), down


def _checkpoint_tensors(loaded: LoadedModels, plan: _Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, model by model. Drafter tensors keep their native `mtp.*` names
    in both layouts (transformers has no drafter modules and ignores them)."""
    for role, model in loaded.models.items():
        hf = plan.layout == HF and role == TARGET
        model_plan = dataclasses.replace(plan, layout=HF if hf else NATIVE)
        for module_name, module in model.named_modules():
            if isinstance(module, RoutedExperts):
                if hf:
                    yield from _hf_stacked_experts(module, module_name)
                    continue
                for w in ("w1", "w3", "w2"):
                    for e in range(module.num_experts):
                        native = f"{module_name}.{e}.{w}.weight"
                        yield from _expert_tensors(module, w, e, native, model_plan)
                continue
            for param_name, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                yield from _plain_tensors(full, param.detach(), model_plan)


class _ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes` (one tensor per shard at least),
    holding one shard in memory; names the files and the index once the shard count is known."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir = out_dir
        self.max_bytes = max_bytes
        self.shards: list[list[str]] = []
        self._names: set[str] = set()
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise RuntimeError(f"save_checkpoint: tensor {name} would be written twice")
        self._names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + size > self.max_bytes:
            self._flush()
        # Own contiguous copy: safetensors refuses tensors that share storage (expert slices of one stack).
        self._current[name] = tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        self._current_bytes += size
        self.total_bytes += size

    def _partial(self, index: int) -> Path:
        return self.out_dir / f"shard-{index + 1:05d}.partial"

    def _flush(self) -> None:
        save_file(self._current, str(self._partial(len(self.shards))), metadata=_SAFETENSORS_METADATA)
        self.shards.append(list(self._current))
        self._current, self._current_bytes = {}, 0

    def close(self) -> None:
        if self._current or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            self._partial(0).rename(self.out_dir / SINGLE_FILE)
            return
        weight_map = {}
        for index, names in enumerate(self.shards):
            file_name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            self._partial(index).rename(self.out_dir / file_name)
            weight_map.update({name: file_name for name in names})
        index_json = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index_json, indent=2))


def check_destination(out_dir: str | Path) -> None:
    """Check, without creating anything that stays, that a new checkpoint can be written to `out_dir`.

    Args:
        out_dir: the directory to write (it may not exist yet).

    Raises:
        ConfigError: it is a file, already holds a checkpoint, or its nearest existing parent refuses a new
            file (permissions, a read-only filesystem).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and (any(out_dir.glob("*.safetensors")) or (out_dir / "config.json").exists()):
        raise ConfigError(f"{out_dir}: already holds a checkpoint; choose an empty or new directory")
    ancestor = out_dir.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{out_dir}: cannot be created, {ancestor} is not a directory")
    try:  # a real probe: permission bits say nothing for root or on a read-only filesystem
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:
        raise ConfigError(f"{out_dir}: cannot write there ({ancestor}: {exc.strerror or exc})") from None


def _check_out_dir(out_dir: Path) -> None:
    check_destination(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)


def save_checkpoint(
    loaded: LoadedModels,
    out_dir: str | Path,
    layout: str = NATIVE,
    dense: str = DENSE_MODEL,
    experts: str = RESIDENT,
    *,
    copy_from: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the models' weights as a checkpoint directory (config.json + safetensors) and return it.

    Args:
        layout: "native" (DeepSeek release names) or "hf" (transformers' names, float only).
        dense: "model" (dense tensors in the resident dtype) or "fp8" (native only: the FP8 linear set as
            e4m3 + 128x128 block scales, like the releases).
        experts: "resident" (the resident bytes), or "fp4" / "fp8" / "dense" (converted).
        copy_from: a checkpoint directory whose tokenizer / generation config files are copied along.
        max_shard_bytes: safetensors files are split (with an index) beyond this size.
    """
    plan = _plan(loaded, layout, dense, experts)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    quant = None
    if plan.quantized:
        quant = QuantConfig(
            weight_block_size=plan.block, scale_fmt=plan.scale_fmt, expert_dtype=plan.experts, fp4_group_size=plan.group
        )
    dtype = loaded.target.dtype
    cfg = dataclasses.replace(loaded.config, quant=quant, torch_dtype=_DTYPE_NAMES.get(dtype, str(dtype)))
    config = cfg.to_native_dict() if layout == NATIVE else cfg.to_hf_dict()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    shards = _ShardWriter(out_dir, max_shard_bytes)
    for name, tensor in track(_checkpoint_tensors(loaded, plan), total=None, desc="write", unit="tensor"):
        shards.add(name, tensor)
    shards.close()
    if copy_from is not None:
        for file_name in COMPANION_FILES:
            source = Path(copy_from) / file_name
            if source.exists():
                shutil.copyfile(source, out_dir / file_name)
    return out_dir
