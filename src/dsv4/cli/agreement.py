"""`dsv4 agreement FILE`: rollout-vs-trainer agreement metrics of a logprob file (see `dsv4.rl.metrics`)."""

from __future__ import annotations

import argparse
import json

EXIT_OK = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dsv4 agreement`'s arguments."""
    parser.add_argument("file", help="a .json or .safetensors file holding rollout_logprobs, trainer_logprobs "
                                     "and optionally mask (per-token logprobs of the sampled tokens, same shape)")
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the agreement metrics of `args.file`.

    Returns:
        0.
    """
    from dsv4.rl.metrics import load_file

    result = load_file(args.file).as_dict()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")
    return EXIT_OK
