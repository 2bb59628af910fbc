"""A dsv4 native checkpoint -> llama.cpp GGUF, through llama.cpp's own DeepSeek-V4 converter.

The converter (`conversion/deepseek.py::DeepseekV4Model` of the llama.cpp that llama-cpp-python 0.3.36
vendors) takes DeepSeek's native release layout as is: native tensor names, a native-spelling config.json,
FP4 routed experts as int8 [out, in/2] + ue8m0 scales [out, in/32], which it repacks losslessly into
ggml's MXFP4 blocks; fp32 tensors stay F32. Two things it cannot take from a benchmark checkpoint, and
the adapters below supply (subclasses in this script; the peer's files are never edited):

- a tokenizer: the benchmark model has none (prompts are random token ids), and the converter hashes a
  real tokenizer to pick llama.cpp's pre-tokenizer. `set_vocab` uses the converter's own built-in
  vocabulary instead (`_set_vocab_builtin("llama-spm", vocab_size)`, llama's SPM vocab cut to the
  model's vocab_size), which llama.cpp loads like any other. Token ids are all the benchmark uses.
- F32 experts (`--experts f32`): the converter always writes the routed experts as MXFP4. The F32
  variant writes each expert stack as the float32 values of those same MXFP4 blocks (the converter's
  repack, then gguf-py's MXFP4 dequantizer), after checking that they equal the checkpoint's FP4 values
  decoded independently (e2m1 code x 2^(scale - 127)): the values dsv4's dense experts hold.

Runs in its own process with the vendored llama.cpp first on sys.path (benchmarks/peer/llama_peer.py
does that): python convert_gguf.py --llama-src SRC CHECKPOINT_DIR OUT.gguf --experts mxfp4|f32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# e2m1 code -> value (bit 3 = sign), the OCP MX table: the independent decode of the checkpoint's FP4 bytes.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)
E8M0_BIAS = 127
FP4_GROUP = 32
EXPERT_FORMATS = ("mxfp4", "f32")


def fp4_values(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 [out, in] of int8/uint8 packed e2m1 [out, in/2] (low nibble = even input) and ue8m0 bytes
    [out, in/32]."""
    raw = packed.view(np.uint8)
    codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    multipliers = np.ldexp(np.float32(1.0), scale.view(np.uint8).astype(np.int32) - E8M0_BIAS).astype(np.float32)
    return E2M1[codes] * np.repeat(multipliers, FP4_GROUP, axis=1)


def converter_classes(llama_src: Path):
    """The vendored converter's DeepSeek-V4 class and its two benchmark adapters (imported from llama_src)."""
    sys.path.insert(0, str(llama_src))  # the converter finds its built-in vocabularies under sys.path[0]/models
    sys.path.insert(1, str(llama_src / "gguf-py"))
    import gguf
    import torch
    from conversion.base import LazyTorchTensor
    from conversion.deepseek import DeepseekV4Model

    class BenchDeepseekV4(DeepseekV4Model):
        """The stock converter with llama.cpp's built-in vocabulary (the benchmark model has no tokenizer)."""

        model_arch = DeepseekV4Model.model_arch  # the converter wants every subclass to state it

        def set_vocab(self):
            self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])

    class BenchDeepseekV4F32Experts(BenchDeepseekV4):
        """Routed experts as float32: the values of the MXFP4 blocks the stock converter would write."""

        model_arch = DeepseekV4Model.model_arch

        def _write_mxfp4_expert_tensor(self, bid: int, proj: str, tensor_key) -> list[str]:
            stack, consumed = [], []
            for eid in range(self.hparams["n_routed_experts"]):
                weight_name = f"layers.{bid}.ffn.experts.{eid}.{proj}.weight"
                scale_name = f"layers.{bid}.ffn.experts.{eid}.{proj}.scale"
                weight = LazyTorchTensor.to_eager(self.model_tensors[weight_name]())
                scale = LazyTorchTensor.to_eager(self.model_tensors[scale_name]())
                blocks = self.repack_mxfp4_blocks(weight, scale)
                values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
                values = values.reshape(weight.shape[0], -1)
                expected = fp4_values(weight.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy())
                if not np.array_equal(values, expected):
                    raise ValueError(f"{weight_name}: MXFP4 blocks do not hold the checkpoint's FP4 values")
                stack.append(values)
                consumed.extend((weight_name, scale_name))
            self.gguf_writer.add_tensor(self.format_tensor_name(tensor_key, bid), np.stack(stack))
            return consumed

        def prepare_tensors(self):
            super().prepare_tensors()
            self.ftype = gguf.LlamaFileType.ALL_F32

    return gguf, {"mxfp4": BenchDeepseekV4, "f32": BenchDeepseekV4F32Experts}


def convert(llama_src: Path, checkpoint: Path, out: Path, experts: str) -> None:
    """Write `out` (GGUF) from the native checkpoint directory with the vendored converter."""
    gguf, classes = converter_classes(llama_src)
    import torch

    with torch.inference_mode():
        model = classes[experts](checkpoint, gguf.LlamaFileType.ALL_F32, out, eager=True)
        model.write()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-src", type=Path, required=True, help="the vendored llama.cpp source directory")
    parser.add_argument("checkpoint", type=Path, help="dsv4 native checkpoint directory (config.json + safetensors)")
    parser.add_argument("out", type=Path, help="GGUF file to write")
    parser.add_argument("--experts", choices=EXPERT_FORMATS, default="mxfp4")
    args = parser.parse_args(argv)
    convert(args.llama_src, args.checkpoint, args.out, args.experts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
