"""`dsv4 env`: the runtime this process sees, and which kernel backend serves each operation and why."""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dsv4 env` takes no options."""


def run(args: argparse.Namespace) -> int:
    """Print versions, device, threads and kernel backends.

    Returns:
        0.
    """
    import torch

    import dsv4
    from dsv4.kernels import describe_backends

    device = f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"
    print(f"dsv4 {dsv4.__version__}")
    print(f"python {sys.version.split()[0]}")
    print(f"torch {torch.__version__}")
    print(f"device: {device}")
    print(f"threads: {torch.get_num_threads()}")
    print(describe_backends())
    return EXIT_OK
