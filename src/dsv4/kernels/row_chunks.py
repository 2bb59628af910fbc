"""Row chunks for elementwise work on large activations.

A prefill of thousands of tokens makes [T, n] activations of tens of MiB. Computing an fp32 widening, a
clamp or an activation over all rows at once allocates a fresh temporary of that size per op, and on
this class of machine the page faults that first touch it cost more than the arithmetic (measured: a
33 MiB bf16 -> fp32 widening 15-18 ms fresh, 2.2 ms into a reused buffer). Chunks of ~1 MiB of fp32
keep every temporary small enough to be reused from the allocator's free lists.
"""

ROW_CHUNK_ELEMENTS = 1 << 18  # 1 MiB of fp32


def row_chunks(rows: int, row_elements: int) -> list[slice]:
    """Slices covering range(rows), each of at most ROW_CHUNK_ELEMENTS elements (at least one row)."""
    step = max(1, ROW_CHUNK_ELEMENTS // max(1, row_elements))
    return [slice(start, start + step) for start in range(0, rows, step)]
