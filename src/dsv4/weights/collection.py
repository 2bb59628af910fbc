"""Automatic garbage collection paused while the lifecycle creates its thousands of short-lived objects.

A load or a refit bucket makes a few containers per tensor (header entries, views, the writer's
bookkeeping), all acyclic: reference counting frees them, or they live as long as the model. Collections
while they are being made find nothing to free; they only promote them, and every so often that promotion
sets off a full collection, which walks every object of the process (with torch loaded, ~170k). Measured
on the development VM: one full collection of 45-56 ms ran in 3 of 5 warm loads of the 1.6 GiB benchmark
model (loads of 240 ms without one), and one of 0.3-0.4 s inside a header parse of it before that.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside (nests); the collector's previous state is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
