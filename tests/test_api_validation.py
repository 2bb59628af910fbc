"""Every public entry point checks its arguments up front: a wrong type is an `ArgumentTypeError` (a Dsv4Error
and a TypeError), a bad value a `ConfigError` / `RequestError` (Dsv4Errors and ValueErrors), each with a one-line
message naming the function, the argument (and list position or request) and the value. A refused call
changes nothing: `LLM(...)` builds no model, a refused generate leaves no request behind, and the engine
answers the next good request exactly as before."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.errors import ArgumentTypeError, ConfigError, Dsv4Error, RequestError

GREEDY = SamplingParams(max_tokens=6)
PROMPT = "sort 4132="


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("dsv4-sort", max_num_seqs=4)


@pytest.fixture(scope="module")
def answer_before(llm) -> list[int]:
    """A good request's tokens before any bad call (module order: this runs first)."""
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _refused(call, error: type[Exception], builtin: type[Exception], needles: list[str]) -> str:
    with pytest.raises(error) as excinfo:
        call()
    exc = excinfo.value
    assert isinstance(exc, Dsv4Error) and isinstance(exc, builtin), type(exc).__mro__
    message = str(exc)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


TYPE, VALUE = ArgumentTypeError, RequestError

# (call on the LLM, error, builtin, needles in the message)
LLM_CALLS = {
    "generate(5)": (lambda m: m.generate(5), TYPE, TypeError, ["generate: prompts", "got int 5"]),
    "generate(None)": (lambda m: m.generate(None), TYPE, TypeError, ["generate: prompts", "NoneType None"]),
    "generate(['a', 5])": (lambda m: m.generate(["a", 5]), TYPE, TypeError, ["prompts[1]", "int 5"]),
    "generate([[1, 2.5]])": (lambda m: m.generate([[1, 2.5]]), TYPE, TypeError, ["prompts[0][1]", "float 2.5"]),
    "generate(dict params)": (lambda m: m.generate("x", {"max_tokens": 3}), TYPE, TypeError,
                              ["sampling_params", "dict {'max_tokens': 3}", "SamplingParams(**params)"]),
    "generate(params count)": (lambda m: m.generate(["a", "b"], [GREEDY]), VALUE, ValueError,
                               ["generate: 2 prompt(s) but 1 sampling params"]),
    "generate(use_tqdm='yes')": (lambda m: m.generate("x", use_tqdm="yes"), TYPE, TypeError,
                                 ["use_tqdm", "str 'yes'"]),
    "stream(5)": (lambda m: next(m.stream(5)), TYPE, TypeError, ["stream: prompts", "int 5"]),
    "chat(None)": (lambda m: m.chat(None), TYPE, TypeError, ["chat: messages", "NoneType None"]),
    "chat([])": (lambda m: m.chat([]), VALUE, ValueError, ["chat: messages is empty"]),
    "chat(no content)": (lambda m: m.chat([{"role": "user"}]), TYPE, TypeError,
                         ["messages[0]['content']", "NoneType None"]),
    "chat(bad flag)": (lambda m: m.chat([{"role": "user", "content": PROMPT}], add_generation_prompt="no"),
                       TYPE, TypeError, ["add_generation_prompt", "str 'no'"]),
    "forward_logprobs([])": (lambda m: m.forward_logprobs([]), VALUE, ValueError, ["token_ids holds no sequence"]),
    "forward_logprobs([[]])": (lambda m: m.forward_logprobs([[]]), VALUE, ValueError, ["token_ids[0] is empty"]),
    "forward_logprobs(flat)": (lambda m: m.forward_logprobs([1, 2, 3]), TYPE, TypeError,
                               ["token_ids must be a list of token-id lists"]),
    "forward_logprobs(id)": (lambda m: m.forward_logprobs([[3, 4], [1, 99]]), VALUE, ValueError,
                             ["token_ids[1]: token id 99 at position 1 is outside the vocabulary [0, 49)"]),
    "forward_logprobs(too long)": (lambda m: m.forward_logprobs([[3] * (m.limits.max_model_len + 1)]), VALUE,
                                   ValueError, ["token_ids[0] has", "more than max_model_len="]),
    "abort(5)": (lambda m: m.abort(5), TYPE, TypeError, ["abort: request_id", "int 5"]),
    "update_weights(5)": (lambda m: m.update_weights(5), TYPE, TypeError, ["update_weights: weights", "int 5"]),
    "update_weights(str)": (lambda m: m.update_weights("head.weight"), TYPE, TypeError, ["update_weights"]),
    "update_weights(tensor)": (lambda m: m.update_weights(torch.zeros(2)), TYPE, TypeError, ["update_weights"]),
    "begin_weight_update(atomic)": (lambda m: m.begin_weight_update(atomic="yes"), TYPE, TypeError,
                                    ["begin_weight_update: atomic", "str 'yes'"]),
    "save_checkpoint(5)": (lambda m: m.save_checkpoint(5), TYPE, TypeError, ["save_checkpoint: out_dir", "int 5"]),
    "save_checkpoint(layout)": (lambda m: m.save_checkpoint("/tmp/never-written", layout=5), TYPE, TypeError,
                                ["save_checkpoint: layout", "int 5"]),
}


@pytest.mark.parametrize("case", list(LLM_CALLS))
def test_llm_methods_refuse_bad_arguments(case, llm, answer_before):
    call, error, builtin, needles = LLM_CALLS[case]
    _refused(lambda: call(llm), error, builtin, needles)
    assert not llm.engine.requests and len(llm.engine.scheduler.free_slots) == llm.limits.max_num_seqs


def test_engine_unchanged_after_refused_calls(llm, answer_before):
    """Runs after the table above (file order): no refused call left a trace."""
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == answer_before
    assert llm.weights_version == 0


def test_bad_prompt_ids_reject_that_request_only_naming_it(llm):
    outs = llm.generate([[1, 99], PROMPT], GREEDY, use_tqdm=False)
    bad, good = outs
    assert bad.outputs == [] and bad.error == (
        f"request {bad.request_id}: token id 99 at position 1 is outside the vocabulary [0, 49)")
    assert good.error is None and good.outputs[0].text == "1234"
    streamed = list(llm.stream([[0, 7, 60]], GREEDY))
    assert len(streamed) == 1 and "token id 60 at position 2" in streamed[0].error


SAMPLING_PARAMS = {
    "stop=5": ({"stop": 5}, TYPE, TypeError, ["SamplingParams.stop", "int 5"]),
    "stop=['a', 3]": ({"stop": ["a", 3]}, TYPE, TypeError, ["SamplingParams.stop", "['a', 3]"]),
    "stop=['']": ({"stop": [""]}, VALUE, ValueError, ["SamplingParams.stop", "empty"]),
    "stop_token_ids=5": ({"stop_token_ids": 5}, TYPE, TypeError, ["SamplingParams.stop_token_ids", "int 5"]),
    "stop_token_ids=[1, 'a']": ({"stop_token_ids": [1, "a"]}, TYPE, TypeError, ["stop_token_ids[1]", "str 'a'"]),
    "temperature=inf": ({"temperature": math.inf}, VALUE, ValueError, ["SamplingParams.temperature", "inf"]),
    "temperature=-1": ({"temperature": -1}, VALUE, ValueError, ["SamplingParams.temperature", ">= 0"]),
    "temperature='0.5'": ({"temperature": "0.5"}, TYPE, TypeError, ["SamplingParams.temperature", "str '0.5'"]),
    "top_p=nan": ({"top_p": math.nan}, VALUE, ValueError, ["SamplingParams.top_p", "nan"]),
    "top_p=0": ({"top_p": 0.0}, VALUE, ValueError, ["SamplingParams.top_p", "(0, 1]"]),
    "seed=1.5": ({"seed": 1.5}, TYPE, TypeError, ["SamplingParams.seed", "float 1.5"]),
    "seed=-1": ({"seed": -1}, VALUE, ValueError, ["SamplingParams.seed", ">= 0"]),
    "n=1000": ({"n": 1000}, VALUE, ValueError, ["SamplingParams.n", "<= 128"]),
    "n=True": ({"n": True}, TYPE, TypeError, ["SamplingParams.n", "bool True"]),
    "max_tokens=0": ({"max_tokens": 0}, VALUE, ValueError, ["SamplingParams.max_tokens", ">= 1"]),
    "ignore_eos='yes'": ({"ignore_eos": "yes"}, TYPE, TypeError, ["SamplingParams.ignore_eos"]),
    "logprobs=21": ({"logprobs": 21}, VALUE, ValueError, ["SamplingParams.logprobs", "<= 20"]),
    "logprobs_mode=5": ({"logprobs_mode": 5}, TYPE, TypeError, ["SamplingParams.logprobs_mode", "int 5"]),
    "logprobs_mode='x'": ({"logprobs_mode": "x"}, VALUE, ValueError, ["SamplingParams.logprobs_mode", "'x'"]),
}


@pytest.mark.parametrize("case", list(SAMPLING_PARAMS))
def test_sampling_params_refuse_bad_fields(case):
    fields, error, builtin, needles = SAMPLING_PARAMS[case]
    _refused(lambda: SamplingParams(**fields), error, builtin, needles)


def _no_cuda_device() -> tuple[str, list[str]]:
    """A CUDA device this machine lacks, and what the error must say about it."""
    if not torch.cuda.is_available():
        return "cuda", ["device 'cuda'", "CUDA is not available", "use device='cpu'"]
    return f"cuda:{torch.cuda.device_count()}", ["CUDA device(s)"]


# (LLM keyword arguments, error, builtin, needles): all refused before any weight is read.
CONSTRUCTOR = {
    "model=5": ({"model": 5}, TYPE, TypeError, ["LLM: model", "int 5"]),
    "missing model": ({"model": "/nonexistent/ckpt"}, ConfigError, ValueError,
                      ["'/nonexistent/ckpt': no such directory", "dsv4-tiny-dummy"]),
    "seed='x'": ({"seed": "x"}, TYPE, TypeError, ["LLM: seed", "str 'x'"]),
    "seed=-1": ({"seed": -1}, ConfigError, ValueError, ["LLM: seed", ">= 0"]),
    "device=cuda": ({"device": _no_cuda_device()[0]}, ConfigError, ValueError, _no_cuda_device()[1]),
    "device='meta'": ({"device": "meta"}, ConfigError, ValueError, ["device 'meta'", "dsv4 runs on cpu or cuda"]),
    "device='banana'": ({"device": "banana"}, ConfigError, ValueError, ["device 'banana' is not a device name"]),
    "device=5": ({"device": 5}, TYPE, TypeError, ["LLM: device", "int 5"]),
    "max_num_seqs='4'": ({"max_num_seqs": "4"}, TYPE, TypeError, ["LLM: max_num_seqs", "str '4'"]),
    "max_model_len=0": ({"max_model_len": 0}, ConfigError, ValueError, ["LLM: max_model_len", ">= 1"]),
    "compile='yes'": ({"compile": "yes"}, TYPE, TypeError, ["LLM: compile", "str 'yes'"]),
    "dtype=5": ({"dtype": 5}, TYPE, TypeError, ["LLM: dtype", "int 5"]),
    "dtype='float16'": ({"dtype": "float16"}, ConfigError, ValueError, ["dtype", "'float16'"]),
    "activation_dtype=32": ({"activation_dtype": 32}, TYPE, TypeError, ["LLM: activation_dtype", "int 32"]),
    "activation_dtype='float16'": ({"activation_dtype": "float16"}, ConfigError, ValueError,
                                   ["activation_dtype: expected None or one of float32|bfloat16", "'float16'"]),
    "activation_dtype narrower": ({"dtype": "float32", "activation_dtype": "bfloat16"}, ConfigError, ValueError,
                                  ["activation_dtype: 'bfloat16' is narrower than dtype 'float32'"]),
    "load_format='pickle'": ({"load_format": "pickle"}, ConfigError, ValueError, ["load_format", "'pickle'"]),
    "draft='eagle'": ({"draft": "eagle"}, ConfigError, ValueError, ["draft", "'eagle'"]),
    "expert_dtype='int4'": ({"expert_dtype": "int4"}, ConfigError, ValueError, ["expert_dtype", "'int4'"]),
    "tensor_parallel_size=0": ({"tensor_parallel_size": 0}, ConfigError, ValueError,
                               ["LLM: tensor_parallel_size", ">= 1"]),
    "tensor_parallel_size='2'": ({"tensor_parallel_size": "2"}, TYPE, TypeError, ["LLM: tensor_parallel_size", "str"]),
    "expert_parallel='yes'": ({"expert_parallel": "yes"}, TYPE, TypeError, ["LLM: expert_parallel", "str 'yes'"]),
    "share_prompt_prefill=1": ({"share_prompt_prefill": 1}, TYPE, TypeError, ["LLM: share_prompt_prefill", "int 1"]),
    "distributed_timeout_s=0": ({"distributed_timeout_s": 0}, ConfigError, ValueError,
                                ["LLM: distributed_timeout_s", "positive"]),
    "distributed_timeout_s='5'": ({"distributed_timeout_s": "5"}, TYPE, TypeError, ["LLM: distributed_timeout_s"]),
    "tp with compile": ({"tensor_parallel_size": 2, "compile": True}, ConfigError, ValueError,
                        ["compile=True", "tensor_parallel_size must be 1"]),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR))
def test_llm_constructor_refuses_bad_arguments_before_building_anything(case, live_models):
    kwargs, error, builtin, needles = CONSTRUCTOR[case]
    kwargs = {"model": "dsv4-tiny-dummy", **kwargs}
    _refused(lambda: LLM(**kwargs), error, builtin, needles)
    gc.collect()
    assert len(live_models) == 0, "a model was built for a call refused on its arguments"


def test_constructor_control_builds_a_model(live_models):
    """Control for the table above: the same call with good arguments builds a model (the guard can fire)."""
    llm = LLM("dsv4-tiny-dummy")
    assert len(live_models) == 1 and llm.loaded.target in live_models


def test_text_prompts_are_checked_against_the_vocabulary_too(tmp_path):
    """A tokenizer that knows more tokens than the model's embedding has rows rejects only the prompts that
    use them, naming the request, the id and its position (the engine never indexes past the embedding)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from dsv4.embedded import EMBEDDED_MODELS

    shutil.copy(EMBEDDED_MODELS["dsv4-tiny-dummy"].path / "config.json", tmp_path / "config.json")
    words = {f"w{i}": i for i in range(600)}  # the tiny config's vocabulary has 512 entries
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(tmp_path, load_format="dummy", max_num_seqs=2)
    bad, good = llm.generate(["w3 w550", "w3 w4"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert bad.error == f"request {bad.request_id}: token id 550 at position 1 is outside the vocabulary [0, 512)"
    assert good.error is None and len(good.outputs[0].token_ids) == 2
