"""The llama.cpp peer of benchmarks/bench_llamacpp.py: where it is built, the benchmark checkpoint both
engines load, its GGUF conversions, and the driver process that runs llama.cpp's side of each workload.

- `PeerBuild`: the paths benchmarks/peer/build_llamacpp.sh produces (sources, libllama, llama_driver).
- `write_bench_checkpoint`: one randomised model (tests/reference.py's recipe) as a dsv4 native
  checkpoint with fp32 dense tensors and FP4 routed experts (int8 e2m1 + ue8m0 scales). dsv4 loads it
  with `expert_dtype="fp4"` (experts stay FP4) or `"dense"` (the FP4 values as fp32 stacks).
- `convert`: that checkpoint -> GGUF with llama.cpp's DeepSeek-V4 converter (convert_gguf.py): MXFP4
  experts (the same FP4 bytes) or F32 experts (the same values). Every other tensor is F32 in both.
- `LlamaDriver`: llama_driver.c as a child process, one command per workload (see its header).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_WORKDIR = HERE.parent / ".peer"  # benchmarks/.peer, ignored by git
SDIST_NAME = "llama_cpp_python-0.3.36"
GGUF_EXPERTS = ("mxfp4", "f32")


@dataclass(frozen=True)
class PeerAttention:
    """How llama.cpp stores its caches and runs attention.

    llama.cpp's defaults (f16 caches, flash attention "auto", which is on for the CPU backend) compute
    attention partly in fp16; with f32 caches and flash attention off, its F32 model computes what dsv4's
    fp32 model computes (the benchmark's logits check measures ~1e-5 max abs difference that way).
    """

    kv_cache: str  # "f32" | "f16" | "bf16"
    flash_attn: str  # "on" | "off" | "auto"


EXACT_ATTENTION = PeerAttention("f32", "off")
DEFAULT_ATTENTION = PeerAttention("f16", "auto")

# Native names of the routed experts: the only tensors stored FP4 (DeepSeek's release layout).
_ROUTED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
# quantization_config of a native checkpoint whose routed experts are FP4 (dense tensors are fp32 here,
# so the FP8 block size is declared but unused).
_FP4_EXPERTS_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                      "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


@dataclass(frozen=True)
class PeerBuild:
    """What build_llamacpp.sh leaves under its work directory."""

    workdir: Path = DEFAULT_WORKDIR

    @property
    def source(self) -> Path:
        return self.workdir / SDIST_NAME / "vendor" / "llama.cpp"

    @property
    def bin(self) -> Path:
        return self.workdir / "build" / "bin"

    @property
    def driver(self) -> Path:
        return self.bin / "llama_driver"

    def check(self) -> None:
        """Raise FileNotFoundError with the build command unless the peer is built."""
        for path in (self.source / "conversion" / "deepseek.py", self.driver):
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: build the peer first with "
                                        f"benchmarks/peer/build_llamacpp.sh --workdir {self.workdir}")


def write_bench_checkpoint(path: Path, config: dict, seed: int) -> None:
    """A dsv4 native checkpoint of `config` (HF form) randomised with `seed`: fp32 tensors, FP4 routed experts."""
    sys.path.insert(0, str(ROOT / "tests"))
    import reference as ref
    from dsv4.quant import quantize_fp4

    model = ref.build_reference_model(config, seed)
    tensors = {}
    for name, tensor in ref.native_state_dict(model).items():
        if _ROUTED_EXPERT.match(name):
            packed, scale = quantize_fp4(tensor)
            tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = packed, scale.view(torch.float8_e8m0fnu)
        else:
            tensors[name] = tensor
    path.mkdir(parents=True, exist_ok=True)
    native = ref.native_config(config, dict(_FP4_EXPERTS_QUANT))

    (path / "config.json").write_text(json.dumps(native, indent=2))
    save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def convert(build: PeerBuild, checkpoint: Path, out: Path, experts: str) -> Path:
    """checkpoint -> out (GGUF) with the vendored converter, in a child Python process (it imports the
    peer's `conversion` package and gguf-py, which must not leak into this process)."""
    if experts not in GGUF_EXPERTS:
        raise ValueError(f"experts must be one of {GGUF_EXPERTS}, got {experts!r}")
    command = [sys.executable, str(HERE / "convert_gguf.py"), "--llama-src", str(build.source), str(checkpoint),
               str(out), "--experts", experts]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if result.returncode != 0:
        raise RuntimeError(f"GGUF conversion ({experts}) failed:\n{result.stderr[-4000:]}")
    return out


class LlamaDriver:
    """llama_driver.c holding one GGUF model, with `threads` threads (see the C file for the protocol)."""

    def __init__(self, build: PeerBuild, gguf: Path, threads: int, log: Path | None = None):
        build.check()
        self._log = open(log, "a") if log is not None else subprocess.DEVNULL  # closed in close()
        self._proc = subprocess.Popen([str(build.driver), str(gguf), str(threads)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1)
        ready = self._proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            self.close()
            raise RuntimeError(f"llama_driver could not load {gguf} (see {log or 'its stderr'})")
        self.n_vocab = int(ready[1])

    def _ask(self, *words) -> list[str]:
        self._proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        reply = self._proc.stdout.readline().split()
        if not reply or reply[0] != "ok":
            raise RuntimeError(f"llama_driver: {' '.join(reply) or 'exited'} (command {words[0]})")
        return reply[1:]

    def context(self, n_seq: int, n_ctx: int, n_batch: int, attention: PeerAttention) -> None:
        """(Re)create the context: n_seq separate sequences, n_ctx cells in all, up to n_batch tokens a call,
        the cache type and flash-attention setting of `attention`."""
        self._ask("ctx", n_seq, n_ctx, n_batch, attention.kv_cache, attention.flash_attn)

    def decode_steps(self, prompt: list[int], steps: int) -> list[float]:
        """Seconds of each of `steps` greedy single-token steps after `prompt` (prefill untimed)."""
        return [float(s) for s in self._ask("decode", steps, len(prompt), *prompt)]

    def generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds to prefill the equal-length prompts and generate new_tokens greedy tokens for each."""
        length = len(prompts[0])
        if any(len(p) != length for p in prompts):
            raise ValueError("generate: the driver takes prompts of one length")
        flat = [t for p in prompts for t in p]
        return float(self._ask("generate", new_tokens, len(prompts), length, *flat)[0])

    def prefill(self, prompt: list[int]) -> float:
        """Seconds of one forward over `prompt` with logits at every position."""
        return float(self._ask("prefill", len(prompt), *prompt)[0])

    def logits(self, prompt: list[int], scratch: Path) -> np.ndarray:
        """float32 logits [len(prompt), n_vocab] of every prompt position."""
        self._ask("logits", scratch, len(prompt), *prompt)
        return np.fromfile(scratch, dtype=np.float32).reshape(len(prompt), self.n_vocab)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> LlamaDriver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
