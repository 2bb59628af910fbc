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


def embedded_model_help() -> str:
    """Help for an option that takes a checkpoint: what the embedded model names are."""
    names = "; ".join(f"{name}: {model.summary}" for name, model in EMBEDDED_MODELS.items())
    return f"a checkpoint directory, or an embedded model's name ({names})"


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
