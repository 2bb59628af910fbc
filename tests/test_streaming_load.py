"""Checkpoint loading streams: memory never grows much past the model's resident size, and a long load
shows progress on a terminal.

The load runs in a fresh interpreter that samples its memory after every tensor written: RssAnon
(anonymous memory: a loader that first read whole files into memory would peak near resident +
checkpoint size) and RssFile (the checkpoint's mapped pages: a reader that keeps a file mapped until it
closes it would grow by the whole file), plus the kernel's high-water mark VmHWM at the end.
"""

import json
import platform
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4 import LLM
from dsv4.weights import loader as loader_module

# Wide enough that the weights dwarf interpreter noise: embed + head alone are 2 * 32768 * 512 * 4 B = 128 MiB.
WIDE = {"vocab_size": 32768, "hidden_size": 512}
# The bound the issue sets: resident + the largest tensor, plus 10%.
HEADROOM = 0.10
# A few MiB the interpreter itself may take while loading (name tables, small conversion buffers).
INTERPRETER_SLACK = 8 * 2**20
# The first Linux release with cachestat(2).
CACHESTAT_KERNEL = (6, 5)

PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    import tqdm.auto  # imported up front: the probe measures tensor streaming, not import costs
    from dsv4.weights import writer as writer_module
    from dsv4.weights.loader import load_models

    def status():
        fields = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
        return fields

    samples = []
    original = writer_module.WeightWriter.load
    def sampled(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        samples.append(status())
        return result
    writer_module.WeightWriter.load = sampled

    torch.set_num_threads(1)
    before = status()
    loaded = load_models(sys.argv[1], dtype=torch.float32)
    after = status()
    resident = sum(p.numel() * p.element_size() for m in loaded.models.values() for p in m.parameters())
    largest = max(p.numel() * p.element_size() for m in loaded.models.values() for p in m.parameters())
    print(json.dumps({"before": before, "after": after, "resident": resident, "largest": largest,
                      "peak_anon": max(s["RssAnon"] for s in samples),
                      "peak_file": max(s["RssFile"] for s in samples)}))
    """
)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    config_dir = root / "config"
    config_dir.mkdir()
    from dsv4.embedded import EMBEDDED_MODELS

    raw = json.loads((EMBEDDED_MODELS["dsv4-tiny-dummy"][0] / "config.json").read_text())
    raw.update(WIDE)
    raw.pop("quantization_config")
    (config_dir / "config.json").write_text(json.dumps(raw))
    source = LLM(config_dir, load_format="dummy", dtype="float32")
    checkpoint = root / "checkpoint"
    source.save_checkpoint(checkpoint, layout="native")
    return checkpoint


def test_checkpoint_load_streams(wide_checkpoint):
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(wide_checkpoint)], capture_output=True, text=True, check=True, timeout=300
    )
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    before, after = stats["before"], stats["after"]
    resident, largest = stats["resident"], stats["largest"]
    assert resident > 128 * 2**20
    bound = (resident + largest) * (1 + HEADROOM) + INTERPRETER_SLACK
    # Peak total RSS (the kernel's high-water mark, file pages included) stays within resident + one tensor.
    assert after["VmHWM"] - before["VmRSS"] <= bound, stats
    # Reading whole files first would add the checkpoint's size (~ the resident size) instead of one tensor.
    assert stats["peak_anon"] - before["RssAnon"] <= bound, stats
    # Mapped checkpoint pages are let go tensor by tensor, not held until the file is closed.
    assert stats["peak_file"] - before["RssFile"] <= largest + INTERPRETER_SLACK, stats


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "pipe"])
def test_load_progress_only_on_a_terminal_after_the_delay(wide_checkpoint, capsys, monkeypatch, tty):
    """A bytes bar on stderr when stderr is a terminal and the load outlasts the delay; nothing otherwise."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    monkeypatch.setattr(loader_module, "PROGRESS_DELAY_S", 3600.0)  # a load this short never shows it
    loader_module.load_models(wide_checkpoint, dtype=torch.float32)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(loader_module, "PROGRESS_DELAY_S", 0.0)
    loader_module.load_models(wide_checkpoint, dtype=torch.float32)
    shown = capsys.readouterr().err
    if tty:
        # A bytes total with a unit prefix (tqdm drops the "B" of "146MB" when the terminal is narrow).
        assert f"loading {wide_checkpoint.name}" in shown and re.search(r"/\s*\d+(\.\d+)?[kMG]", shown), shown
    else:
        assert shown == ""


def test_tensors_at_unaligned_offsets_read_correctly(tmp_path):
    """safetensors does not align tensor data: a float32 tensor may start at an odd byte. The zero-copy view
    must then give way to an aligned copy, with the same values."""
    import struct

    from dsv4.weights.checkpoint import CheckpointDir

    odd = torch.arange(3, dtype=torch.int8)
    values = torch.linspace(-2, 2, 10, dtype=torch.float32).view(2, 5)
    header = {
        "odd": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
        "values": {"dtype": "F32", "shape": [2, 5], "data_offsets": [3, 43]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the header itself is padded; the data after it is not
    data = odd.numpy().tobytes() + values.numpy().tobytes()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    tensors = {name: t.clone() for name, t, _ in CheckpointDir(tmp_path).iter_tensors()}
    assert torch.equal(tensors["odd"], odd) and torch.equal(tensors["values"], values)


def test_streamed_tensors_equal_safetensors_own_reader(tmp_path):
    """Every streamed tensor (one strided view of a per-dtype view of the mapped file) holds exactly what
    safetensors' own reader reads: every rank from 0-D to 4-D, empty tensors, and each dtype a checkpoint uses."""
    from safetensors.torch import load_file, save_file

    from dsv4.weights.checkpoint import CheckpointDir

    generator = torch.Generator().manual_seed(0)
    values = {
        "scalar": torch.tensor(3.25),
        "vector": torch.randn(7, generator=generator),
        "matrix_bf16": torch.randn(5, 3, generator=generator).to(torch.bfloat16),
        "stack": torch.randn(2, 3, 4, generator=generator),
        "four_d": torch.randn(2, 1, 3, 5, generator=generator).to(torch.float16),
        "empty": torch.empty(0, 4),
        "codes": torch.randn(6, 8, generator=generator).to(torch.float8_e4m3fn),
        "packed": torch.randint(-128, 128, (3, 5), dtype=torch.int8, generator=generator),
        "scales": torch.randint(0, 255, (4, 3), dtype=torch.uint8, generator=generator),
        "table": torch.randint(0, 9, (3, 2), dtype=torch.int64, generator=generator),
        "ids": torch.randint(0, 9, (11,), dtype=torch.int32, generator=generator),
    }
    save_file(values, tmp_path / "model.safetensors")
    want = load_file(tmp_path / "model.safetensors")
    got = {name: tensor.clone() for name, tensor, _ in CheckpointDir(tmp_path).iter_tensors()}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        # Bytes, not values: bit for bit, and defined for every dtype (NaN codes included).
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_header_parse_leaves_the_collector_as_it_found_it(tmp_path, enabled):
    """Reading headers pauses automatic collection and restores the previous state, on success and failure."""
    import gc

    from safetensors.torch import save_file

    from dsv4.errors import CheckpointError
    from dsv4.weights.checkpoint import CheckpointDir, read_header

    save_file({"w": torch.ones(2, 2)}, tmp_path / "model.safetensors")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{not json")
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        assert set(read_header(tmp_path / "model.safetensors")) == {"w"}
        assert gc.isenabled() == enabled
        with pytest.raises(CheckpointError, match="unreadable safetensors header"):
            CheckpointDir(tmp_path / "bad")
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def _resident_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_tensors_read_straight_into_their_destination_equal_safetensors_own_reader(tiny_release_dir, monkeypatch):
    """FP4 expert bytes, their ue8m0 scales and float tensors already in the resident dtype and layout are read
    from the file into the model's own storage (no mapped view, no copy): each holds exactly the bytes
    safetensors' own reader reads, and every other tensor still streams through the mapping."""
    from safetensors.torch import load_file

    from dsv4.weights import checkpoint as checkpoint_module
    from dsv4.weights.loader import load_models

    direct: set[str] = set()
    original = checkpoint_module._writable_bytes

    def recording(info, dest):
        direct.add(info.name)
        return original(info, dest)

    monkeypatch.setattr(checkpoint_module, "_writable_bytes", recording)
    loaded = load_models(tiny_release_dir, dtype=torch.float32)
    want = load_file(tiny_release_dir / "model.safetensors")
    routes = loaded.routes()
    kinds = set()
    for name in direct:
        route = routes.resolve(name)
        dest = route.slot.dest if route.kind == "weight" else route.slot.scale_dest
        kinds.add((route.kind, route.slot.kind, want[name].dtype))
        assert torch.equal(_resident_bytes(dest), _resident_bytes(want[name])), name
    assert {("weight", "fp4", torch.int8), ("scale", "fp4", torch.float8_e8m0fnu),
            ("weight", "float", torch.float32)} <= kinds, kinds
    # FP8 linears (dequantized into fp32) and row-major matrices of input-major weights are converted, not placed.
    assert not any(want[name].dtype == torch.float8_e4m3fn for name in direct)
    assert len(direct) < len(want)


@pytest.mark.parametrize("split", [False, True], ids=["one_read", "split_reads"])
def test_a_file_cut_short_after_its_header_was_read_names_the_file_and_tensor(tiny_release_dir, tmp_path, split,
                                                                              monkeypatch):
    """A read straight into a destination that finds the file shorter than its header promised (cut while the
    load ran) fails with a CheckpointError naming the file and the tensor, where a mapped view would fault: in
    one read of a run of tensors, and in a run split into several reads at once (`weights/work_split.py`)."""
    import shutil

    from dsv4.errors import CheckpointError
    from dsv4.weights import work_split
    from dsv4.weights.checkpoint import TORCH_DTYPES, CheckpointDir

    if split:  # three parts of every run, however small
        monkeypatch.setattr(work_split, "usable_cpus", lambda: 3)
        monkeypatch.setattr(work_split, "MIN_PART_BYTES", 1)

    shutil.copytree(tiny_release_dir, tmp_path / "ckpt")
    checkpoint = CheckpointDir(tmp_path / "ckpt")
    last = max(checkpoint.tensors.values(), key=lambda info: info.offset)
    with last.file.open("r+b") as f:
        f.truncate(last.offset + last.nbytes // 2)

    def everything(name, dtype, shape):
        info = checkpoint.tensors[name]
        return torch.empty(info.nbytes, dtype=torch.uint8).view(TORCH_DTYPES[info.dtype]).view(shape)

    with pytest.raises(CheckpointError, match=rf"{re.escape(str(last.file))}: tensor {re.escape(last.name)}: "
                                              r"the file ends inside its data \(truncated\)"):
        for _ in checkpoint.iter_tensors(destination=everything):
            pass


def test_values_read_into_place_are_still_checked(tiny_release_dir, tmp_path):
    """A bad value in a tensor read straight into the model (a NaN in a float tensor kept as it is, the e8m0 NaN
    byte in an FP4 expert's scale) is refused with the file and the tensor named, and no model is returned."""
    from safetensors.torch import load_file, save_file

    from dsv4.errors import CheckpointError
    from dsv4.weights.loader import load_models

    tensors = load_file(tiny_release_dir / "model.safetensors")
    cases = {"norm.weight": ("non-finite", lambda t: t.index_fill(0, torch.tensor([1]), float("nan"))),
             "layers.2.ffn.experts.1.w1.scale": ("0xFF", lambda t: torch.full_like(t.view(torch.uint8), 0xFF)
                                                 .view(torch.float8_e8m0fnu))}
    for name, (needle, corrupt) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text((tiny_release_dir / "config.json").read_text())
        save_file({**tensors, name: corrupt(tensors[name])}, bad / "model.safetensors")
        with pytest.raises(CheckpointError) as excinfo:
            load_models(bad, dtype=torch.float32)
        message = str(excinfo.value)
        assert str(bad / "model.safetensors") in message and f"tensor {name}" in message and needle in message


def test_only_fresh_unsharded_loads_place_tensors(tiny_release_dir):
    """`WeightWriter.destination` offers a destination only for a fresh load's tensors that are their resident
    bytes as they are: never to a refit (atomic or fail-stop: values are checked before they land), never to a
    tensor that needs a conversion, a transpose or another dtype."""
    from dsv4.errors import CheckpointError
    from dsv4.weights.loader import load_models
    from dsv4.weights.writer import WeightWriter

    loaded = load_models(tiny_release_dir, dtype=torch.float32)
    routes = loaded.routes()
    fresh = WeightWriter(routes, loaded.layout, CheckpointError, fresh=True)
    expert = routes.resolve("layers.2.ffn.experts.1.w1.weight").slot
    assert fresh.destination(expert.native, torch.int8, tuple(expert.dest.shape)).data_ptr() == expert.dest.data_ptr()
    assert fresh.destination("layers.2.ffn.experts.1.w1.scale", torch.float8_e8m0fnu,
                             tuple(expert.scale_dest.shape)) is not None
    assert fresh.destination(expert.native, torch.int8, (1, *expert.dest.shape)) is None  # another shape
    norm = routes.resolve("norm.weight").slot
    assert fresh.destination("norm.weight", torch.float32, tuple(norm.dest.shape)) is not None
    assert fresh.destination("norm.weight", torch.bfloat16, tuple(norm.dest.shape)) is None  # converted
    linear = routes.resolve("layers.1.attn.wq_b.weight").slot
    assert not linear.dest.is_contiguous()  # input-major: a transposing copy
    assert fresh.destination(linear.native, torch.float32, tuple(linear.dest.shape)) is None
    assert fresh.destination(linear.native, torch.float8_e4m3fn, tuple(linear.dest.shape)) is None  # dequantized
    assert fresh.destination("no.such.weight", torch.float32, (4,)) is None
    for refit in (WeightWriter(routes, loaded.layout, CheckpointError),
                  WeightWriter(routes, loaded.layout, CheckpointError, staged=True, fresh=True),
                  WeightWriter(routes, loaded.layout, CheckpointError, dry_run=True, fresh=True)):
        assert refit.destination(expert.native, torch.int8, tuple(expert.dest.shape)) is None


@pytest.mark.parametrize("layout", ["contiguous", "sliced", "transposed"])
def test_the_e8m0_check_finds_the_nan_byte_wherever_it_lies(layout):
    """A memchr over contiguous bytes, a max reduction over strided ones: both find a lone 0xFF at any place and
    pass every other byte (254 included)."""
    from dsv4.weights.convert import ConversionError, e8m0_bytes

    shape = (6, 40)
    arrange = {"contiguous": lambda t: t, "sliced": lambda t: t[:, 8:], "transposed": lambda t: t.t()}[layout]
    clean = torch.full(shape, 254, dtype=torch.uint8)
    assert e8m0_bytes(arrange(clean).view(torch.float8_e8m0fnu)).dtype == torch.uint8
    for index in (0, 17, 40 + 7, 6 * 40 - 1):
        bad = clean.clone()
        bad.view(-1)[index] = 0xFF
        view = arrange(bad)
        if int(view.max()) != 0xFF:
            continue  # sliced off
        with pytest.raises(ConversionError, match="NaN byte 0xFF"):
            e8m0_bytes(view)


def test_readahead_stays_within_its_lead_and_stops_when_closed(tmp_path, monkeypatch):
    """The reads run ahead of the loader by at most the lead, follow the loader as it reports progress, cover
    the extents (not the gaps between them), and stop (thread gone) on close."""
    import mmap
    import threading

    from dsv4.weights import readahead as readahead_module

    page = mmap.PAGESIZE
    file = tmp_path / "data"
    file.write_bytes(bytes(8 * page))
    read: list[int] = []  # lengths asked for, in order

    def recording(address, length):
        read.append(length)
        return True

    monkeypatch.setattr(readahead_module, "populate", recording)
    monkeypatch.setattr(readahead_module, "file_cached", lambda fd, start, length: False)  # a cold file
    monkeypatch.setattr(readahead_module, "cached", lambda address, length: False)

    def settled():  # the thread has asked for everything the lead allows
        for _ in range(200):
            before = len(read)
            threading.Event().wait(0.005)
            if len(read) == before:
                return

    ahead = readahead_module.Readahead([(file, 0, 5 * page), (file, 6 * page, 8 * page)], lead_bytes=2 * page,
                                       chunk_bytes=page)
    settled()
    assert read == [page, page]  # two chunks fill the lead: no more until the loader moves
    ahead.advance(page)
    settled()
    assert read == [page] * 3
    ahead.advance(10 * page)
    settled()
    assert read == [page] * 7  # five pages of the first extent, two of the second: the gap is not read
    ahead.close()
    assert not any(t.name == "dsv4-readahead" for t in threading.enumerate())
    waiting = readahead_module.Readahead([(file, 0, 8 * page)], lead_bytes=page, chunk_bytes=page)
    waiting.close()  # closed while it waits for room: returns, the thread ends
    assert not any(t.name == "dsv4-readahead" for t in threading.enumerate())


def test_readahead_leaves_the_file_cached_and_nothing_mapped(tmp_path):
    """The real reads (madvise MADV_POPULATE_READ): the process keeps none of the pages it read ahead."""
    from dsv4.weights.readahead import Readahead

    file = tmp_path / "data"
    file.write_bytes(bytes(range(256)) * 4096)  # 1 MiB

    def rss_file() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
        return 0

    before = rss_file()
    with Readahead([(file, 0, file.stat().st_size)]) as ahead:
        ahead._thread.join(5)
    assert rss_file() - before < 512 * 1024
    assert file.read_bytes()[:256] == bytes(range(256))


@pytest.mark.parametrize("asked", ["cachestat", "mincore"])
def test_readahead_skips_an_extent_the_page_cache_holds(tmp_path, monkeypatch, asked):
    """An extent whose pages the kernel reports all cached (cachestat(2), or mincore(2) on a mapping where
    cachestat does not answer) is not read at all (a warm load's thread walks nothing); one with a page
    missing is read chunk by chunk, as a cold one."""
    import mmap

    from dsv4.weights import readahead as readahead_module

    page = mmap.PAGESIZE
    file = tmp_path / "data"
    file.write_bytes(bytes(range(256)) * (4 * page // 256))  # 4 pages, read back: cached
    assert file.read_bytes()[:4] == bytes(range(4))
    with file.open("rb") as f:
        answer = readahead_module.file_cached(f.fileno(), 0, 4 * page)
    if asked == "cachestat" and answer is None:
        # Only a kernel without cachestat(2) (before Linux 6.5) may leave the question to mincore.
        release = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
        assert release < CACHESTAT_KERNEL, f"cachestat(2) did not answer on Linux {platform.release()}"
        asked = "mincore"
    if asked == "mincore":  # a kernel without cachestat
        monkeypatch.setattr(readahead_module, "file_cached", lambda fd, start, length: None)
    read: list[int] = []
    monkeypatch.setattr(readahead_module, "populate", lambda address, length: read.append(length) or True)
    with readahead_module.Readahead([(file, 0, 4 * page)], chunk_bytes=page) as ahead:
        ahead._thread.join(5)
    assert read == []
    if asked == "cachestat":
        real_cachestat = readahead_module._cachestat()

        def one_page_missing(number, fd, asked_range, counts, flags):
            result = real_cachestat(number, fd, asked_range, counts, flags)
            readahead_module._Cachestat.from_address(counts).nr_cache -= 1
            return result

        monkeypatch.setattr(readahead_module, "_cachestat", lambda: one_page_missing)
    else:
        real_mincore = readahead_module._mincore()

        def one_page_missing(address, length, vector):
            result = real_mincore(address, length, vector)
            vector[1] = b"\x00"
            return result

        monkeypatch.setattr(readahead_module, "_mincore", lambda: one_page_missing)
    with readahead_module.Readahead([(file, 0, 4 * page)], chunk_bytes=page) as ahead:
        ahead._thread.join(5)
    assert read == [page] * 4


def test_a_load_asks_for_its_files_before_it_builds_the_model(tiny_release_dir, monkeypatch):
    """A one-process load starts the checkpoint's disk reads before the model build, over every tensor's bytes."""
    from dsv4.weights import loader as loader_module
    from dsv4.weights import readahead as readahead_module

    events: list[str] = []
    asked: list[int] = []
    original_build = loader_module.build_models
    original_init = readahead_module.Readahead.__init__

    def building(*args, **kwargs):
        events.append("build")
        return original_build(*args, **kwargs)

    def starting(self, extents, *args, **kwargs):
        events.append("readahead")
        asked.append(sum(end - start for _, start, end in extents))
        original_init(self, extents, *args, **kwargs)

    monkeypatch.setattr(loader_module, "build_models", building)
    monkeypatch.setattr(readahead_module.Readahead, "__init__", starting)
    loaded = loader_module.load_models(tiny_release_dir, dtype=torch.float32)
    assert events == ["readahead", "build"]
    from dsv4.weights.checkpoint import CheckpointDir

    assert asked == [sum(info.nbytes for info in CheckpointDir(tiny_release_dir).tensors.values())]
    assert loaded.target is not None


def test_no_tensor_is_placed_outside_cpu_memory(tiny_release_dir):
    """The kernel reads a file only into the process's own memory: models on another device get no
    destination for any tensor (every tensor then streams through a view and is copied across)."""
    from dsv4.config import ModelConfig
    from dsv4.weights.checkpoint import TORCH_DTYPES, CheckpointDir
    from dsv4.weights.loader import build_models, quant_layout, resolve_expert_format
    from dsv4.weights.routes import RouteTable
    from dsv4.weights.slots import SlotTable
    from dsv4.weights.writer import WeightWriter

    cfg = ModelConfig.from_file(tiny_release_dir)
    models = build_models(cfg, resolve_expert_format(cfg, None), torch.float32, "meta", None)
    writer = WeightWriter(RouteTable(SlotTable(models)), quant_layout(cfg), fresh=True)
    infos = CheckpointDir(tiny_release_dir).tensors.values()
    assert not any(writer.destination(i.name, TORCH_DTYPES[i.dtype], i.shape) is not None for i in infos)
    cpu = build_models(cfg, resolve_expert_format(cfg, None), torch.float32, "cpu", None)
    on_cpu = WeightWriter(RouteTable(SlotTable(cpu)), quant_layout(cfg), fresh=True)
    assert any(on_cpu.destination(i.name, TORCH_DTYPES[i.dtype], i.shape) is not None for i in infos)
