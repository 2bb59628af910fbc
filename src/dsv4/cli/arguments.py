"""Argument types and help texts shared by the subcommands. argparse reports a rejected value as one line
naming the option, e.g. ``dsv4 eval: error: argument --n: must be a positive integer, got 0``."""

from __future__ import annotations

import argparse
import math

from dsv4.embedded import EMBEDDED_MODELS


def positive_int(text: str) -> int:
    """An int >= 1 (argparse type)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (argparse type)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that shape the engine a command runs the model with, the same in every subcommand that
    loads one (`dsv4 generate`, `dsv4 serve`): dtypes, device and the speculative drafter."""
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="activation and dense-weight dtype (auto: the checkpoint's)")
    parser.add_argument("--activation-dtype", choices=("float32", "bfloat16"), default=None,
                        help="activations and caches, when wider than --dtype (bfloat16 weights at rest with "
                             "float32 math; default: --dtype)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    parser.add_argument("--draft", choices=("mtp", "dspark"), default=None,
                        help="speculative decoding with this drafter from the checkpoint")
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                        help="draft tokens per sequence and step with --draft (default: the drafter's: 3 for mtp, "
                             "dspark's block)")


def embedded_model_help() -> str:
    """Help for an option that takes a checkpoint: what the embedded model names are."""
    names = "; ".join(f"{name}: {model.summary}" for name, model in EMBEDDED_MODELS.items())
    return f"a checkpoint directory, or an embedded model's name ({names})"


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
