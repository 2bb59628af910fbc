"""`dsv4 convert`: rewrite a checkpoint (or an embedded model) in another layout or format.

What the source stores is kept unless an option says otherwise: FP8 dense linears stay FP8 and routed
experts keep their format, as far as the target layout can hold them (the HF layout holds floats only).
Every option combination is checked, and the destination probed, before the source is loaded. The last
lines say what was written, read back from the written files' headers.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dsv4.cli.arguments import embedded_model_help
from dsv4.config import DENSE, FP4, FP8
from dsv4.errors import ConfigError

KEEP = "keep"
NATIVE, HF = "native", "hf"
DENSE_MODEL_DTYPE, DENSE_FP8 = "model", "fp8"
EXIT_OK = 0
MEBIBYTE = 1024**2
FP8_WEIGHT_DTYPE = "F8_E4M3"  # safetensors name of float8_e4m3fn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 convert`."""
    parser.add_argument("src", help=embedded_model_help())
    parser.add_argument("dst", help="the directory to write (new, or empty)")
    parser.add_argument("--layout", choices=(NATIVE, HF), required=True,
                        help="native: DeepSeek's release names (any format); hf: transformers' names, floats only")
    parser.add_argument("--dense", choices=(KEEP, DENSE_MODEL_DTYPE, DENSE_FP8), default=KEEP,
                        help="dense linears: keep what the source stores, the model dtype, or FP8 e4m3 with "
                             "128x128 block scales (native layout only)")
    parser.add_argument("--experts", choices=(KEEP, FP4, FP8, DENSE), default=KEEP,
                        help="routed experts: keep the source's format, or convert (fp4/fp8: native layout only)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="dtype of the unquantized tensors (auto: the source's)")


def check_options(layout: str, dense: str, experts: str) -> None:
    """Reject what the layout cannot hold, in the command line's own spelling, before anything loads.

    Raises:
        ConfigError: an impossible combination.
    """
    if layout == HF:
        float_choices = {"--experts": (experts, (KEEP, DENSE)), "--dense": (dense, (KEEP, DENSE_MODEL_DTYPE))}
        for option, (value, floats) in float_choices.items():
            if value not in floats:
                raise ConfigError(f"--layout hf stores every tensor in float: {option} {value} needs --layout native")
    if dense == DENSE_FP8 and experts == DENSE:
        raise ConfigError("--dense fp8 needs quantized experts (--experts fp4 or fp8): a quantization_config "
                          "always declares the experts' format")


def run(args: argparse.Namespace) -> int:
    """Load SRC, write DST, say what was written.

    Returns:
        0 on success (errors raise and become one line with status 2).
    """
    from dsv4.config import ModelConfig
    from dsv4.embedded import resolve_model
    from dsv4.engine.llm import resolve_dtype
    from dsv4.weights.checkpoint import CheckpointDir
    from dsv4.weights.export import RESIDENT, check_destination, save_checkpoint
    from dsv4.weights.inspection import drafter_in
    from dsv4.weights.loader import load_models

    start = time.perf_counter()
    check_options(args.layout, args.dense, args.experts)
    check_destination(args.dst)
    src, load_format = resolve_model(args.src)
    cfg = ModelConfig.from_file(src)
    checkpoint = CheckpointDir(src) if load_format != "dummy" else None
    source_dense_fp8 = checkpoint is not None and _stores_fp8_dense(checkpoint)
    experts = RESIDENT if args.experts == KEEP else args.experts
    source_experts = cfg.quant.expert_dtype if cfg.quant is not None else DENSE
    written_experts, experts_note = _resolve_experts(args.experts, args.layout, source_experts)
    dense, dense_note = _resolve_dense(args.dense, args.layout, source_dense_fp8, written_experts)
    draft = drafter_in(cfg, checkpoint) if checkpoint is not None else None
    loaded = load_models(src, load_format=load_format, dtype=resolve_dtype(args.dtype, cfg), draft=draft)
    out = save_checkpoint(loaded, args.dst, args.layout, dense, experts, copy_from=src)
    print(describe_written(out, dense_note, experts_note, list(loaded.models), time.perf_counter() - start))
    return EXIT_OK


def _stores_fp8_dense(checkpoint) -> bool:
    """Whether the source keeps its dense linears as FP8 (then "keep" writes them as FP8 again)."""
    from dsv4.weights.export import FP8_LINEAR
    from dsv4.weights.names import canonical_name

    return any(info.dtype == FP8_WEIGHT_DTYPE and FP8_LINEAR.match(canonical_name(name))
               for name, info in checkpoint.tensors.items())


def _resolve_experts(choice: str, layout: str, source: str) -> tuple[str, str]:
    """--experts -> the experts' format in the output, and why, for the summary."""
    if layout == HF and source != DENSE:
        return DENSE, f"dequantized from the source's {source}: the HF layout holds floats only"
    if choice == KEEP or layout == HF:
        return source, "kept from the source"
    return choice, "as asked"


def _resolve_dense(choice: str, layout: str, source_fp8: bool, written_experts: str) -> tuple[str, str]:
    """--dense keep -> what to write, and why, for the summary."""
    if choice != KEEP:
        return choice, "as asked"
    if not source_fp8:
        return DENSE_MODEL_DTYPE, "kept from the source"
    if layout == HF:
        return DENSE_MODEL_DTYPE, "dequantized from the source's FP8: the HF layout holds floats only"
    if written_experts == DENSE:
        return DENSE_MODEL_DTYPE, "dequantized from the source's FP8: FP8 dense linears need quantized experts"
    return DENSE_FP8, "kept from the source"


def describe_written(out: Path, dense_note: str, experts_note: str, models: list[str], seconds: float) -> str:
    """What a conversion wrote, read back from the written headers (so it cannot disagree with the files).

    Args:
        out: the written directory.
        dense_note: why the dense linears have their format.
        experts_note: why the routed experts have their format.
        models: the models written (target and drafters).
        seconds: how long the conversion took.

    Returns:
        A few lines for the terminal.
    """
    from dsv4.config import ModelConfig
    from dsv4.weights.export import COMPANION_FILES, FP8_LINEAR
    from dsv4.weights.inspection import inspect_checkpoint
    from dsv4.weights.names import canonical_name

    cfg = ModelConfig.from_file(out)
    written = inspect_checkpoint(out, cfg)
    checkpoint_dtypes = _dtypes_by_name(out)
    linear = {d for n, d in checkpoint_dtypes.items() if FP8_LINEAR.match(canonical_name(n))}
    dense = "FP8 e4m3 with block scales" if linear == {FP8_WEIGHT_DTYPE} else f"{cfg.torch_dtype}"
    experts = cfg.quant.expert_dtype if cfg.quant else f"dense ({cfg.torch_dtype})"
    copied = [f for f in COMPANION_FILES if (out / f).exists()]
    files = "1 file" if written.files == 1 else f"{written.files} files"
    return "\n".join([
        f"wrote {out} in {seconds:.2f} s: {written.format} layout, {files}, {written.tensors} tensors, "
        f"{written.bytes / MEBIBYTE:.1f} MiB",
        f"  dense linears: {dense} ({dense_note})",
        f"  routed experts: {experts} ({experts_note})",
        f"  other tensors: {cfg.torch_dtype}; models: {', '.join(models)}",
        f"  companion files copied: {', '.join(copied) or 'none'}",
        f"  loadable: {'yes' if written.loadable else 'no'}",
    ])


def _dtypes_by_name(out: Path) -> dict[str, str]:
    from dsv4.weights.checkpoint import CheckpointDir

    return {name: info.dtype for name, info in CheckpointDir(out).tensors.items()}
