"""A checkpoint directory on disk: config.json plus safetensors (one file, or sharded with an index).

Tensors stream one at a time (peak memory ~ resident model + one tensor). Headers are validated up
front so a corrupt or truncated file fails before any weight is written. Only safetensors are read:
never pickle.
"""

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dsv4.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
_HEADER_LEN_BYTES = 8  # safetensors: little-endian u64 header size, then the JSON header
_MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    file: Path


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header without reading tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(_HEADER_LEN_BYTES)
            if len(raw_len) < _HEADER_LEN_BYTES:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(size, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: corrupt safetensors header length {header_len}")
            header = json.loads(f.read(header_len))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    data_len = size - _HEADER_LEN_BYTES - header_len
    infos = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        if dtype == "F4":
            raise CheckpointError(
                f"{path}: tensor {name} is stored as F4 (float4_e2m1fn_x2), which safetensors cannot slice; "
                f"store FP4 experts as I8 packed bytes (two e2m1 codes per byte) as DeepSeek's releases do"
            )
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * DTYPE_BYTES[dtype] or end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name} data [{begin}, {end}) does not fit its shape {list(shape)} {dtype} "
                f"or the file ({data_len} data bytes): truncated or corrupt"
            )
        infos[name] = TensorInfo(name=name, dtype=dtype, shape=shape, file=path)
    return infos


class CheckpointDir:
    """The safetensors files of a checkpoint directory and the tensors they hold."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            problem = "is a file, not a checkpoint directory" if self.path.exists() else "no such directory"
            raise CheckpointError(f"{self.path}: {problem}")
        self.files = self._files()
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise CheckpointError(f"{file}: tensor {name} also appears in {self.tensors[name].file}")
                self.tensors[name] = info
        self._check_index()

    def _files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: invalid index ({exc})") from None
            files = sorted({self.path / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.path}: no *.safetensors files (dsv4 loads safetensors only); to run this config with "
                f'seeded dummy weights, load it with load_format="dummy" (--load-format dummy on the command line)'
            )
        return files

    def _check_index(self) -> None:
        index = self.path / INDEX_FILE
        if not index.exists():
            return
        weight_map = json.loads(index.read_text())["weight_map"]
        for name, file in weight_map.items():
            info = self.tensors.get(name)
            if info is None or info.file.name != file:
                raise CheckpointError(f"{index}: tensor {name} is listed in {file} but not found there")

    def iter_tensors(
        self, wanted: Callable[[str], bool] = lambda name: True
    ) -> Iterator[tuple[str, torch.Tensor, str]]:
        """Yield (name, tensor, file) one tensor at a time, file by file."""
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        if wanted(name):
                            yield name, f.get_tensor(name), str(file)
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types for corrupt data
                if isinstance(exc, (KeyboardInterrupt, MemoryError)):
                    raise
                raise CheckpointError(f"{file}: cannot read tensors ({exc})") from exc
