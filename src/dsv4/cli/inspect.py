"""`dsv4 inspect`: would a checkpoint load, and what is in it? Reads config.json, the safetensors headers and
the tokenizer files, never tensor data (the checks live in `dsv4.weights.inspection`)."""

from __future__ import annotations

import argparse
import json

from dsv4.cli.arguments import embedded_model_help
from dsv4.config import DENSE

EXIT_OK, EXIT_PROBLEMS = 0, 2
SHOWN_NAMES = 20  # lines listed per problem kind in text output (--json lists all)
MEBIBYTE = 1024**2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 inspect`."""
    parser.add_argument("checkpoint", help=embedded_model_help())
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--draft", choices=("mtp", "dspark"), default=None,
                        help="check the mtp.* tensors against this drafter (default: the one the checkpoint carries)")


def run(args: argparse.Namespace) -> int:
    """Inspect and print.

    Returns:
        0 when the checkpoint would load, 2 when it would not (the problems are listed).
    """
    from dsv4.config import ModelConfig
    from dsv4.embedded import resolve_model

    path, load_format = resolve_model(args.checkpoint)
    cfg = ModelConfig.from_file(path)
    report = {"path": str(path), "load_format": load_format}
    if load_format == "dummy":
        report.update({"weights": "seeded dummy values (load format dummy): no files to check"})
    else:
        from dsv4.weights.inspection import inspect_checkpoint

        report.update(inspect_checkpoint(path, cfg, args.draft).to_json())
    report["companion_files"] = _companion_files(path)
    problems = report["companion_files"]["problems"]
    report["loadable"] = report.get("loadable", True) and not problems
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text(report, cfg)
    return EXIT_OK if report["loadable"] else EXIT_PROBLEMS


def _companion_files(path) -> dict:
    """The tokenizer and chat template as `LLM` opens them; a broken one is a problem like a bad tensor."""
    from dsv4.engine.chat_template import ChatTemplate
    from dsv4.engine.tokenizer import load_tokenizer
    from dsv4.errors import ConfigError

    found = {"tokenizer_tokens": None, "chat_template": False, "problems": []}
    try:
        tokenizer = load_tokenizer(path)
        if tokenizer is not None:
            found["tokenizer_tokens"] = tokenizer.get_vocab_size(with_added_tokens=True)
    except ConfigError as exc:
        found["problems"].append(str(exc))
    try:
        found["chat_template"] = ChatTemplate.from_checkpoint(path) is not None
    except ConfigError as exc:
        found["problems"].append(str(exc))
    return found


def _print_text(report: dict, cfg) -> None:
    print(f"checkpoint: {report['path']}")
    experts = cfg.quant.expert_dtype if cfg.quant else DENSE
    print(f"layers: {cfg.num_hidden_layers}, hidden: {cfg.hidden_size}, "
          f"routed experts: {cfg.n_routed_experts} ({experts})")
    if "weights" in report:
        print(f"weights: {report['weights']}")
    else:
        print(f"format: {report['format']}")
        print(f"files: {report['files']}, tensors: {report['tensors']}, size: {report['bytes'] / MEBIBYTE:.1f} MiB")
        dtypes = (f"{d} x{e['tensors']} ({e['bytes'] / MEBIBYTE:.1f} MiB)" for d, e in report["dtypes"].items())
        print("dtypes: " + ", ".join(dtypes))
        print(f"parameters: {report['parameters']:,}")
        print(f"drafter: {report['drafter'] or 'none'}")
        for title in ("rejected", "missing", "unpaired"):
            _print_list(title, report[title])
        if report["ignored"]:
            print(f"ignored (a load skips them): {len(report['ignored'])}")
    companions = report["companion_files"]
    tokens = companions["tokenizer_tokens"]
    print(f"tokenizer: {f'{tokens} tokens' if tokens is not None else 'none (prompts must be token ids)'}")
    print(f"chat template: {'yes' if companions['chat_template'] else 'none'}")
    _print_list("companion file problems", companions["problems"])
    print("loadable: " + ("yes" if report["loadable"] else "no"))


def _print_list(title: str, lines: list[str]) -> None:
    if not lines:
        return
    print(f"{title} ({len(lines)})")
    for line in lines[:SHOWN_NAMES]:
        print(f"  {line}")
    if len(lines) > SHOWN_NAMES:
        print(f"  ... (+{len(lines) - SHOWN_NAMES} more; --json lists all)")
