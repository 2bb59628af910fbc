"""Fixtures shared by the test files: the tiny transformers reference model and checkpoints written from it,
engine builders, and guards that make a test fail when a call loads or reads more than it should.

The tiny model and its checkpoints are session-scoped: built once, read-only for every test (a test that
needs to break a checkpoint copies it first).
"""

from __future__ import annotations

import importlib.util
import sys
import weakref
from pathlib import Path

import pytest
import torch

import reference as ref

# The test models are tiny: their forwards are dispatch-bound, and intra-op threads only add
# synchronisation overhead (severe when the machine's two cores are shared).
torch.set_num_threads(1)

TINY_SEED = 4242  # weights of the shared tiny reference model
PROMPT_SEED = 5
PROMPT_LEN = 48
# Ids 0 and 1 are bos / eos in the tiny config; prompts draw from the rest of the vocabulary.
FIRST_ORDINARY_ID = 2
# Engine limits that keep a tiny-model LLM's cache small: the tests score prompts of at most PROMPT_LEN.
SMALL_ENGINE = {"dtype": "float32", "max_num_seqs": 2, "max_model_len": 64}


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmark_script():
    """Imports a script of benchmarks/ by name (they are scripts, not a package) and forgets it after the test.
    The module is registered in sys.modules while it runs: dataclasses resolve their module through it."""
    loaded = []

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """`length` seeded token ids of ordinary (non-special) tokens."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_ID, vocab_size, (length,), generator=generator).tolist()


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    """The tiny HF config (4 layers: every attention and MLP type)."""
    return ref.tiny_config()


@pytest.fixture(scope="session")
def tiny_reference(tiny_config):
    """transformers' DeepseekV4ForCausalLM (fp32) with every tensor randomised: the numerical oracle."""
    return ref.build_reference_model(tiny_config, TINY_SEED)


@pytest.fixture(scope="session")
def tiny_native(tiny_reference) -> dict[str, torch.Tensor]:
    """The reference model's tensors under native names, fp32 (210 tensors)."""
    return ref.native_state_dict(tiny_reference)


@pytest.fixture(scope="session")
def tiny_prompt(tiny_config) -> list[int]:
    return random_prompt(tiny_config["vocab_size"], PROMPT_LEN, PROMPT_SEED)


@pytest.fixture(scope="session")
def tiny_logprobs(tiny_reference, tiny_prompt) -> torch.Tensor:
    """The oracle's fp32 [len, vocab] log-probabilities of `tiny_prompt`."""
    return ref.reference_logprobs(tiny_reference, tiny_prompt)


@pytest.fixture(scope="session")
def tiny_native_dir(tmp_path_factory, tiny_config, tiny_native) -> Path:
    """A native-layout fp32 checkpoint of the reference model."""
    path = tmp_path_factory.mktemp("tiny_native")
    ref.write_native_checkpoint(path, tiny_config, tiny_native)
    return path


@pytest.fixture(scope="session")
def tiny_release_dir(tmp_path_factory, tiny_config, tiny_native) -> Path:
    """The reference model as DeepSeek's releases store it: FP8 dense linears, FP4 routed experts (ue8m0)."""
    path = tmp_path_factory.mktemp("tiny_release")
    ref.write_native_checkpoint(path, tiny_config, tiny_native, dense="fp8", expert_dtype="fp4")
    return path


@pytest.fixture(scope="session")
def tiny_transformers_saved_dir(tmp_path_factory, tiny_reference) -> Path:
    """The reference model as transformers' save_pretrained writes it (HF prefixes on native suffixes)."""
    path = tmp_path_factory.mktemp("tiny_transformers_saved")
    ref.save_hf_checkpoint(tiny_reference, path)
    return path


@pytest.fixture(scope="session")
def make_llm():
    """Build an `LLM` with small engine limits (`SMALL_ENGINE`, overridable per call)."""
    from dsv4 import LLM

    def build(path, **overrides):
        return LLM(path, **{**SMALL_ENGINE, **overrides})

    return build


@pytest.fixture
def live_models(monkeypatch) -> weakref.WeakSet:
    """A WeakSet of every target model constructed during the test: after a failed load and a garbage
    collection it must be empty (nothing half-loaded survives)."""
    from dsv4.model.deepseek_v4 import DeepseekV4

    alive: weakref.WeakSet = weakref.WeakSet()
    original = DeepseekV4.__init__

    def tracking_init(self, *args, **kwargs):
        alive.add(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(DeepseekV4, "__init__", tracking_init)
    return alive


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Make loading weights fail: for calls that must be refused before any weight is read or written."""

    # llm.py binds `load_models` by name at import: import it first, so that it never binds the stand-in.
    import dsv4.engine.llm  # noqa: F401

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded although the call should have been refused up front")

    monkeypatch.setattr("dsv4.engine.llm.load_models", refuse)
    monkeypatch.setattr("dsv4.weights.loader.load_models", refuse)


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Make any read of tensor data fail: for code that may only read config.json and safetensors headers."""
    import safetensors
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr("dsv4.weights.checkpoint.map_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors.torch, "safe_open", refuse)


def _write_word_tokenizer(path, vocab: int, tokenizer_config: dict | None = None) -> None:
    """A word-level tokenizer over `vocab` ids: id i <-> "w{i}", words joined by spaces when decoded."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.fixture(scope="session")
def write_word_tokenizer():
    """`write(path, vocab, tokenizer_config=None)`: give a test checkpoint a word-level tokenizer
    (id i <-> "w{i}"), so text, stop strings and chat templates can be tested on random models."""
    return _write_word_tokenizer
