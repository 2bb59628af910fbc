"""A load's large byte work split across threads (weights/work_split.py) writes exactly the bytes of the unsplit
work: transposing, straight and dequantizing copies cut into row / element ranges, and placed checkpoint reads
cut into byte ranges (a split read of a file cut short: test_streaming_load.py); a failed piece is raised on the
caller's thread once every piece has ended; and a whole load pauses automatic garbage collection, restoring it
after."""

import gc
import itertools
import threading

import pytest
import torch

from dsv4.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise
from dsv4.weights import checkpoint as checkpoint_module
from dsv4.weights import layout_copy, work_split
from dsv4.weights.convert import QuantLayout, dequantize

# Parts the tests force on any machine: three, whatever its cores, however small the work.
FORCED_PARTS = 3


@pytest.fixture
def forced_split(monkeypatch):
    """Every piece of work is cut into FORCED_PARTS parts, and the parts that ran are recorded."""
    monkeypatch.setattr(work_split, "usable_cpus", lambda: FORCED_PARTS)
    monkeypatch.setattr(work_split, "MIN_PART_BYTES", 1)
    pieces: list[list[tuple[int, int]]] = []
    original = work_split.run_parts

    def recording(work, bounds):
        pieces.append(list(itertools.pairwise(bounds)))
        return original(work, bounds)

    for module in (work_split, layout_copy, checkpoint_module):  # and where it was imported by name
        monkeypatch.setattr(module, "run_parts", recording)
    return pieces


def _input_major(shape, dtype):
    return torch.zeros(shape[1], shape[0], dtype=dtype).t()


@pytest.mark.parametrize("total,parts,align", [(200, 3, 64), (1000, 2, 64), (10, 4, 64), (4096 * 3 + 5, 2, 4096)])
def test_cut_points_cover_the_work_in_aligned_pieces(total, parts, align):
    bounds = work_split.cut_points(total, parts, align)
    assert bounds[0] == 0 and bounds[-1] == total
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert all(cut % align == 0 for cut in bounds[1:-1])
    assert len(bounds) - 1 <= parts


def test_part_count_follows_cores_and_size(monkeypatch):
    monkeypatch.setattr(work_split, "usable_cpus", lambda: 2)
    assert work_split.part_count(work_split.MIN_PART_BYTES - 1) == 1
    assert work_split.part_count(10 * work_split.MIN_PART_BYTES) == 2
    monkeypatch.setattr(work_split, "usable_cpus", lambda: 64)
    assert work_split.part_count(1000 * work_split.MIN_PART_BYTES) == work_split.MAX_PARTS


def test_parts_run_at_once_and_a_failed_piece_is_raised_after_all_end():
    """The caller runs the first piece itself; every piece runs even when one fails, and the failure is
    raised on the caller's thread."""
    caller = threading.get_ident()
    ran: dict[int, int] = {}
    all_started = threading.Barrier(3, timeout=30)  # broken unless the three pieces run at the same time

    def work(first, stop):
        ran[first] = threading.get_ident()
        all_started.wait()
        return stop - first

    assert work_split.run_parts(work, [0, 10, 25, 40]) == [10, 15, 15]
    assert ran[0] == caller and len({ran[0], ran[10], ran[25]}) == 3

    def failing(first, stop):
        ran[first] = -1
        if first == 10:
            raise ValueError("piece 10 failed")
        return stop - first

    with pytest.raises(ValueError, match="piece 10 failed"):
        work_split.run_parts(failing, [0, 10, 25, 40])
    assert set(ran.values()) == {-1}


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("stream", [False, True], ids=["cached_stores", "streaming_stores"])
def test_split_transposing_copies_equal_torch_and_check_every_part(forced_split, dtypes, stream):
    incoming, resident = dtypes
    shape = (200, 72)  # three row ranges: [0, 64), [64, 128), [128, 200)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(incoming)
    dest = _input_major(shape, resident)
    assert layout_copy.copy_checking_finite(dest, values, stream=stream) is True
    assert forced_split[-1] == [(0, 64), (64, 128), (128, 200)]
    bits = torch.int16 if resident.itemsize == 2 else torch.int32
    assert torch.equal(dest.contiguous().view(bits), values.to(resident).view(bits))
    for row in (0, 63, 64, 127, 128, 199):  # a non-finite value in any part is reported
        corrupt = values.clone()
        corrupt[row, 71] = float("inf")
        assert layout_copy.copy_checking_finite(dest, corrupt, stream=stream) is False, row


def test_split_straight_copies_equal_torch_and_check_every_part(forced_split):
    values = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    dest = torch.zeros(1000)
    assert layout_copy.copy_checking_finite(dest, values) is True
    assert len(forced_split[-1]) == FORCED_PARTS
    assert torch.equal(dest, values)
    for position in (0, 500, 999):
        corrupt = values.clone()
        corrupt[position] = float("nan")
        assert layout_copy.copy_checking_finite(dest, corrupt) is False, position


@pytest.mark.parametrize("resident", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_split_fp8_dequantization_equals_torch(forced_split, resident, scale_fmt):
    """Cut at block rows: each part reads its own rows of block scales."""
    shape, block = (300, 256), (64, 128)
    codes, scale = quantize_fp8_blockwise(torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 3,
                                          block, scale_fmt)
    dest = _input_major(shape, resident)
    layout = QuantLayout(fp8_block=block, fp4_group=32, scale_fmt=scale_fmt)
    dequantize(codes, scale, layout, shape, resident, out=dest)
    assert forced_split[-1] == [(0, 64), (64, 192), (192, 300)]
    bits = torch.int16 if resident.itemsize == 2 else torch.int32
    expected = dequantize_fp8_blockwise(codes, scale, block, resident)
    assert torch.equal(dest.contiguous().view(bits), expected.view(bits))


def test_split_reads_place_the_bytes_of_safetensors_own_reader(tiny_release_dir, forced_split, monkeypatch):
    """Placed tensors read by several preadv(2) calls at once, cut inside tensors: the same bytes."""
    from safetensors.torch import load_file

    from dsv4.weights.checkpoint import TORCH_DTYPES, CheckpointDir

    monkeypatch.setattr(checkpoint_module, "_READ_PART_ALIGN", 64)  # cuts every 64 bytes: inside tensors
    checkpoint = CheckpointDir(tiny_release_dir)

    def everything(name, dtype, shape):
        info = checkpoint.tensors[name]
        return torch.zeros(info.nbytes, dtype=torch.uint8).view(TORCH_DTYPES[info.dtype]).view(shape)

    got = {name: tensor.clone() for name, tensor, _ in checkpoint.iter_tensors(destination=everything)}
    assert any(len(pieces) > 1 for pieces in forced_split)
    want = load_file(tiny_release_dir / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_a_load_pauses_the_collector_and_restores_it(tiny_release_dir, monkeypatch, enabled):
    from dsv4.weights import writer as writer_module
    from dsv4.weights.loader import load_models

    seen: list[bool] = []
    fail_at: list[int] = []  # the call that fails, when set
    original = writer_module.WeightWriter.load

    def recording(self, *args, **kwargs):
        seen.append(gc.isenabled())
        if len(seen) in fail_at:
            raise RuntimeError("a write failed mid-load")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(writer_module.WeightWriter, "load", recording)
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        load_models(tiny_release_dir)
        assert seen and not any(seen)
        assert gc.isenabled() == enabled
        fail_at.append(len(seen) + 5)
        with pytest.raises(RuntimeError, match="a write failed mid-load"):
            load_models(tiny_release_dir)
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
