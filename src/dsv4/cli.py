"""`dsv4` command line: inspect | convert | generate | env. One function per subcommand.

    dsv4 inspect CHECKPOINT [--json] [--draft mtp|dspark]
    dsv4 convert SRC DST --layout native|hf [--experts resident|fp4|fp8|dense] [--dense model|fp8]
    dsv4 generate [PROMPT ...] [--model M] [--max-tokens N] [--temperature T]
    dsv4 env
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

EXIT_OK, EXIT_ERROR, EXIT_PROBLEMS = 0, 1, 2
NATIVE_FORMAT, HF_FORMAT, MIXED_FORMAT = "native", "hf", "transformers-saved (HF prefixes, native suffixes)"
HF_PREFIX = "model."
HF_HEAD = "lm_head.weight"
DRAFTER_PREFIX = "mtp."
SCALE_SUFFIX = ".scale"
PACKED_DTYPES = ("I8", "U8")  # FP4 experts: two e2m1 codes per byte
QUANTIZED_WEIGHT_DTYPES = ("F8_E4M3",)
DEMO_TOKEN_PROMPTS = ((2, 3, 4, 5), (10, 20, 30), (7,))
TOKEN_ID_PROMPT = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")
_SHOWN_NAMES = 20  # names listed per problem kind in text output (--json lists all)
_MEGABYTE = 1024**2


# ---- inspect ----
@dataclass
class NameCheck:
    """The outcome of mapping a checkpoint's names onto models built on the meta device (no data)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)
    unpaired: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def problems(self) -> bool:
        return bool(self.missing or self.unexpected or self.shape_mismatches or self.unpaired)


def detect_format(names: Sequence[str]) -> str:
    """native: no `model.` prefix. hf: every non-drafter name prefixed, layer names in HF spelling.
    Otherwise what transformers' save_pretrained writes: HF prefixes on native suffixes (and an
    unprefixed `head.weight`)."""
    from dsv4.weights.names import canonical_name

    own = [n for n in names if not n.startswith(DRAFTER_PREFIX)]
    prefixed = [n for n in own if n.startswith(HF_PREFIX) or n == HF_HEAD]
    if not prefixed:
        return NATIVE_FORMAT
    native_suffix_layers = [
        n for n in prefixed if n.startswith(f"{HF_PREFIX}layers.") and canonical_name(n) == n[len(HF_PREFIX) :]
    ]
    if len(prefixed) == len(own) and not native_suffix_layers:
        return HF_FORMAT
    return MIXED_FORMAT


def _meta_tensors(checkpoint) -> list[tuple[str, str, str, torch.Tensor]]:
    """(incoming name, safetensors dtype, native name, meta tensor) per native tensor the checkpoint
    carries: HF stacked experts split per expert exactly as a load would, on the meta device (no data)."""
    from dsv4.weights.names import canonical_tensors

    out = []
    for name, info in checkpoint.tensors.items():
        meta = torch.empty(info.shape, device="meta")
        out.extend((name, info.dtype, native, t) for native, t in canonical_tensors(name, meta))
    return out


def _expected_shapes(table, slot) -> set[tuple[int, ...]]:
    """Shapes an incoming weight may have: the resident shape, or for experts the logical [out, in]
    (float / fp8) and the packed FP4 [out, in/2]."""
    from dsv4.model.moe import FP4

    resident = tuple(table.param(slot).shape)
    if not slot.is_expert:
        return {resident}
    out_dim, in_dim = resident[1:]
    if table.expert_format(slot) == FP4:
        in_dim *= 2
    return {(out_dim, in_dim), (out_dim, in_dim // 2)}


def check_names(checkpoint, cfg, draft: str | None) -> NameCheck:
    """Dry-run the name mapping against the models' slot table (models built on the meta device)."""
    from dsv4.weights.loader import build_models, resolve_expert_format
    from dsv4.weights.slots import SlotTable
    from dsv4.weights.writer import ALIASED_DRAFTER_TENSORS

    models = build_models(cfg, resolve_expert_format(cfg, None), torch.float32, "meta", draft)
    table = SlotTable(models)
    result = NameCheck()
    weights, scales, needs_scale = set(), set(), set()
    for incoming, dtype, native, tensor in _meta_tensors(checkpoint):
        is_scale = native.endswith(SCALE_SUFFIX)
        weight = native[: -len(SCALE_SUFFIX)] + ".weight" if is_scale else native
        slot = table.get(weight)
        if slot is None:
            if ALIASED_DRAFTER_TENSORS.match(native) or (native.startswith(DRAFTER_PREFIX) and draft is None):
                result.ignored.append(incoming)
            elif incoming not in result.unexpected:
                result.unexpected.append(incoming)
            continue
        if is_scale:
            scales.add(weight)
            continue
        weights.add(weight)
        if dtype in QUANTIZED_WEIGHT_DTYPES or (slot.is_expert and dtype in PACKED_DTYPES):
            needs_scale.add(weight)
        if tuple(tensor.shape) not in _expected_shapes(table, slot):
            want = " or ".join(str(list(s)) for s in sorted(_expected_shapes(table, slot)))
            result.shape_mismatches.append(f"{incoming} ({native}): {list(tensor.shape)}, expected {want}")
    result.missing = sorted(table.names() - weights)
    result.unpaired = sorted(f"{w} has no scale" for w in needs_scale - scales)
    result.unpaired += sorted(f"{w}: a scale without its weight" for w in scales - weights)
    return result


def parameter_count(checkpoint) -> int:
    """Logical parameters: scales excluded, packed FP4 bytes counted as two values each."""
    from dsv4.weights.names import canonical_name

    canonical = {name: canonical_name(name) for name in checkpoint.tensors}
    scale_of = {c[: -len(SCALE_SUFFIX)] for c in canonical.values() if c.endswith(SCALE_SUFFIX)}
    total = 0
    for name, info in checkpoint.tensors.items():
        native = canonical[name]
        if native.endswith(SCALE_SUFFIX):
            continue
        numel = 1
        for d in info.shape:
            numel *= d
        packed = info.dtype in PACKED_DTYPES and native.removesuffix(".weight") in scale_of
        total += numel * (2 if packed else 1)
    return total


def _print_names(title: str, names: list[str]) -> None:
    print(f"{title} ({len(names)})")
    for name in names[:_SHOWN_NAMES]:
        print(f"  {name}")
    if len(names) > _SHOWN_NAMES:
        print(f"  ... (+{len(names) - _SHOWN_NAMES} more; --json lists all)")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Describe a checkpoint from config.json and the safetensors headers only (no tensor data is read)."""
    from dsv4.config import ModelConfig
    from dsv4.weights.checkpoint import DTYPE_BYTES, CheckpointDir

    cfg = ModelConfig.from_file(args.checkpoint)
    checkpoint = CheckpointDir(args.checkpoint)
    dtypes: dict[str, dict[str, int]] = {}
    for info in checkpoint.tensors.values():
        numel = 1
        for d in info.shape:
            numel *= d
        entry = dtypes.setdefault(info.dtype, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += numel * DTYPE_BYTES[info.dtype]
    names = check_names(checkpoint, cfg, args.draft)
    report = {
        "path": str(checkpoint.path),
        "format": detect_format(list(checkpoint.tensors)),
        "files": len(checkpoint.files),
        "tensors": len(checkpoint.tensors),
        "bytes": sum(e["bytes"] for e in dtypes.values()),
        "dtypes": dict(sorted(dtypes.items())),
        "parameters": parameter_count(checkpoint),
        "expert_dtype": cfg.quant.expert_dtype if cfg.quant else "dense",
        "missing": names.missing,
        "unexpected": names.unexpected,
        "shape_mismatches": names.shape_mismatches,
        "unpaired": names.unpaired,
        "ignored": names.ignored,
        "loadable": not names.problems,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_PROBLEMS if names.problems else EXIT_OK
    print(f"checkpoint: {report['path']}")
    print(f"format: {report['format']}")
    experts = f"{cfg.n_routed_experts} ({report['expert_dtype']})"
    print(f"layers: {cfg.num_hidden_layers}, hidden: {cfg.hidden_size}, routed experts: {experts}")
    print(f"files: {report['files']}, tensors: {report['tensors']}, size: {report['bytes'] / _MEGABYTE:.1f} MiB")
    histogram = (f"{d} x{e['tensors']} ({e['bytes'] / _MEGABYTE:.1f} MiB)" for d, e in report["dtypes"].items())
    print("dtypes: " + ", ".join(histogram))
    print(f"parameters: {report['parameters']:,}")
    for title, key in (("missing", "missing"), ("unexpected", "unexpected"), ("shape mismatches", "shape_mismatches"),
                       ("unpaired weight/scale", "unpaired")):
        _print_names(title, report[key])
    if names.ignored:
        print(f"ignored drafter tensors: {len(names.ignored)} (pass --draft to check them)")
    print("loadable: " + ("yes" if report["loadable"] else "no"))
    return EXIT_PROBLEMS if names.problems else EXIT_OK


# ---- convert ----
def _drafter_in(cfg, checkpoint) -> str | None:
    """Which drafter the checkpoint carries, from its names (`mtp.*`) and config (`dspark_*`)."""
    from dsv4.weights.names import canonical_name

    if not any(canonical_name(n).startswith(DRAFTER_PREFIX) for n in checkpoint.tensors):
        return None
    return "dspark" if cfg.dspark is not None else "mtp"


def cmd_convert(args: argparse.Namespace) -> int:
    """Load SRC (any layout) and write it to DST in the requested layout and formats."""
    from dsv4.config import ModelConfig
    from dsv4.engine.llm import resolve_dtype
    from dsv4.weights.checkpoint import CheckpointDir
    from dsv4.weights.export import save_checkpoint
    from dsv4.weights.loader import load_models

    start = time.perf_counter()
    cfg = ModelConfig.from_file(args.src)
    draft = _drafter_in(cfg, CheckpointDir(args.src))
    loaded = load_models(args.src, dtype=resolve_dtype(args.dtype, cfg), draft=draft)
    out = save_checkpoint(loaded, args.dst, args.layout, args.dense, args.experts, copy_from=args.src)
    models = ", ".join(loaded.models)
    print(f"wrote {out} ({args.layout} layout, dense {args.dense}, experts {args.experts}; models: {models}) "
          f"in {time.perf_counter() - start:.2f} s")
    return EXIT_OK


# ---- generate ----
def _parse_prompt(prompt: str) -> str | list[int]:
    if TOKEN_ID_PROMPT.match(prompt):
        return [int(t) for t in prompt.split(",")]
    return prompt


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for the given prompts (or a few demo prompts); print prompt, answer and timing."""
    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as exc:
        print(f"dsv4 generate: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    start = time.perf_counter()
    llm = LLM(args.model)
    loaded_at = time.perf_counter()
    if args.prompt:
        prompts = [_parse_prompt(p) for p in args.prompt]
    elif llm.tokenizer is not None:
        from dsv4.evaluate import DEMO_PROMPTS  # the embedded default model's task

        prompts = list(DEMO_PROMPTS)
    else:
        prompts = [[t % llm.config.vocab_size for t in ids] for ids in DEMO_TOKEN_PROMPTS]
    outputs = llm.generate(prompts, params)
    done = time.perf_counter()
    generated = 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        generated += len(completion.token_ids)
        answer = completion.text if completion.text is not None else ",".join(map(str, completion.token_ids))
        print(f"prompt: {prompt if isinstance(prompt, str) else ','.join(map(str, prompt))}")
        print(f"answer: {answer}  [{completion.finish_reason}]")
    seconds = done - loaded_at
    print(f"load {loaded_at - start:.2f} s, generate {seconds:.2f} s, {generated} tokens "
          f"({generated / max(seconds, 1e-9):.1f} tok/s), weights version {llm.weights_version}")
    return EXIT_OK


# ---- env ----
def cmd_env(args: argparse.Namespace) -> int:
    """The runtime this process sees."""
    import dsv4

    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"
    print(f"dsv4 {dsv4.__version__}")
    print(f"python {sys.version.split()[0]}")
    print(f"torch {torch.__version__}")
    print(f"device: {device}")
    print(f"threads: {torch.get_num_threads()}")
    from dsv4.kernels import describe_backends

    print(describe_backends())
    return EXIT_OK


# ---- entry point ----
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="describe a checkpoint without reading tensor data")
    inspect.add_argument("checkpoint")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--draft", choices=("mtp", "dspark"), help="also check the drafter's tensors")
    inspect.set_defaults(func=cmd_inspect)

    convert = sub.add_parser("convert", help="rewrite a checkpoint in another layout / format")
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--layout", choices=("native", "hf"), required=True)
    convert.add_argument("--experts", choices=("resident", "fp4", "fp8", "dense"), default="resident")
    convert.add_argument("--dense", choices=("model", "fp8"), default="model")
    convert.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    convert.set_defaults(func=cmd_convert)

    generate = sub.add_parser("generate", help="generate text (or token ids) for a few prompts")
    generate.add_argument("prompt", nargs="*", help='text, or token ids like "1,2,3"')
    generate.add_argument("--model", default=None, help="checkpoint directory or embedded model name")
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.set_defaults(func=cmd_generate)

    from dsv4 import evaluate

    eval_parser = sub.add_parser("eval", help="score the embedded models on held-out examples of their task")
    evaluate.add_arguments(eval_parser)
    eval_parser.set_defaults(func=evaluate.run)

    from dsv4.rl import metrics

    agreement = sub.add_parser("agreement", help="rollout-vs-trainer agreement metrics of a logprob file")
    metrics.add_arguments(agreement)
    agreement.set_defaults(func=metrics.run)

    env = sub.add_parser("env", help="print the runtime environment")
    env.set_defaults(func=cmd_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dsv4.errors import Dsv4Error

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Dsv4Error as exc:
        print(f"dsv4 {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
