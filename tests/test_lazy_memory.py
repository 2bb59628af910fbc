"""LazyZeros: a zero tensor whose memory is taken where it is written, and given back by release().

Memory is read from /proc/self/status (RssAnon: the process's anonymous resident pages) in a fresh
interpreter, so that nothing else this test process allocates moves the numbers.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4.model.lazy_memory import LAZY_MIN_BYTES, LazyZeros

MIB = 2**20

PROBE = textwrap.dedent(
    """
    import json, torch
    from dsv4.model.lazy_memory import LazyZeros

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    out = {"start": anon()}
    buffer = LazyZeros((64, 1024, 1024), torch.float32)  # 256 MiB: 64 rows of 4 MiB
    out["created"] = anon()
    out["reads_zero"] = bool((buffer.tensor.sum(dim=(1, 2)) == 0).all())
    out["after_read"] = anon()
    ptr = buffer.tensor.data_ptr()
    buffer.tensor[:4].fill_(1.5)  # 16 MiB written
    out["after_write"] = anon()
    out["written_values"] = float(buffer.tensor[:4].mean()) == 1.5 and float(buffer.tensor[4:].abs().max()) == 0
    buffer.release(slice(0, 4))
    out["after_release"] = anon()
    out["released_reads_zero"] = float(buffer.tensor[:4].abs().max()) == 0
    out["same_storage"] = buffer.tensor.data_ptr() == ptr
    buffer.tensor[8:12].fill_(2.0)
    del buffer
    out["after_free"] = anon()
    print(json.dumps(out))
    """
)


def test_memory_is_taken_where_written_and_given_back():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["created"] - m["start"] < 4 * MIB  # a 256 MiB zero tensor costs nothing up front
    assert m["reads_zero"] and m["after_read"] - m["start"] < 4 * MIB  # reading maps the zero page
    assert 15 * MIB < m["after_write"] - m["after_read"] < 20 * MIB  # the 16 MiB written, about nothing more
    assert m["written_values"]
    assert m["after_release"] - m["after_read"] < 2 * MIB and m["released_reads_zero"] and m["same_storage"]
    assert m["after_free"] - m["start"] < 4 * MIB  # the mapping goes with its last tensor


@pytest.mark.parametrize("rows", [slice(1, 3), 2, slice(0, 5)])
def test_release_zeroes_exactly_its_rows_even_off_page_boundaries(rows):
    """Rows of 1000 bytes straddle pages: whole pages are returned, the partial edges zeroed in place."""
    buffer = LazyZeros((200, 250), torch.float32)
    assert buffer.lazy and buffer.nbytes >= LAZY_MIN_BYTES
    buffer.tensor.fill_(7.0)
    buffer.release(rows)
    expected = torch.full((200, 250), 7.0)
    expected[rows] = 0
    assert torch.equal(buffer.tensor, expected)


def test_small_buffers_and_other_devices_are_plain_zeros():
    small = LazyZeros((4, 8), torch.bfloat16)
    assert not small.lazy and small.tensor.dtype == torch.bfloat16 and not bool(small.tensor.any())
    small.tensor.fill_(1)
    small.release(slice(1, 3))
    assert small.tensor[:, 0].tolist() == [1, 0, 0, 1]
    with pytest.raises(ValueError, match="step 1"):
        LazyZeros((100, 1000), torch.float32).release(slice(0, 10, 2))
