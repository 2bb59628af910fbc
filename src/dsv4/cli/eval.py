"""`dsv4 eval`: score the embedded models on fresh held-out examples of their task (`dsv4.evaluate`)."""

from __future__ import annotations

import argparse
import json

from dsv4.cli.arguments import non_negative_int, positive_int
from dsv4.evaluate import DEFAULT_N, DEFAULT_SEED  # no torch at import

EXIT_OK = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 eval`."""
    parser.add_argument("--n", type=positive_int, default=DEFAULT_N, help="held-out examples per variant")
    parser.add_argument("--seed", type=non_negative_int, default=DEFAULT_SEED,
                        help="seed of the held-out sample (training draws from its own seeds 0, 1, ...)")
    parser.add_argument("--models-dir", default=None,
                        help="score the two model folders a training run wrote there instead of the embedded ones")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the table (or JSON).

    Returns:
        0.
    """
    from dsv4.evaluate import evaluate, format_table

    result = evaluate(n=args.n, seed=args.seed, models_dir=args.models_dir)
    print(json.dumps(result.to_json()) if args.json else format_table(result))
    return EXIT_OK
