"""Batching never changes results: a prompt decoded alone vs inside a batch of 16 mixed-length prompts
(chunked prefill interleaved with decode, few cache slots so later prompts join mid-flight, and a
second wave added while the first is running) gives identical greedy tokens and logprobs (fp32)."""

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams

LOGPROB_TOL = 1e-5
N_PROMPTS = 16
SEED = 21
TOP_K = 3


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model on a shared machine: one thread beats two contended ones
    path = tmp_path_factory.mktemp("batching")
    ref.save_hf_checkpoint(ref.build_reference_model(ref.tiny_config(), SEED), path)
    # 6 slots for 16 prompts: admission control queues the rest; a 40-token budget chunks long prompts.
    yield LLM(str(path), dtype="float32", max_num_seqs=6, max_num_batched_tokens=40, max_model_len=256)
    torch.set_num_threads(saved)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    lengths = [1, 3, 5, 9, 17, 31, 33, 47, 64, 90, 2, 12, 40, 70, 100, 7]
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


def _params(i: int) -> SamplingParams:
    # Different lengths so sequences leave at different steps and free slots mid-flight.
    return SamplingParams(max_tokens=8 + (i * 5) % 17, ignore_eos=True, logprobs=TOP_K)


def _same(alone, batched):
    assert alone.token_ids == batched.token_ids
    assert len(alone.logprobs) == len(batched.logprobs) == len(alone.token_ids)
    for a, b in zip(alone.logprobs, batched.logprobs):
        assert a.keys() == b.keys()
        for token, lp in a.items():
            assert abs(lp - b[token]) <= LOGPROB_TOL


def test_batch_of_16_with_mid_flight_joins_equals_alone(llm):
    prompts = _prompts()
    alone = [llm.generate([p], _params(i), use_tqdm=False)[0].outputs[0] for i, p in enumerate(prompts)]
    engine = llm.engine
    first, second = range(10), range(10, N_PROMPTS)
    requests = {i: engine.add_request(f"b{i}", prompts[i], _params(i)) for i in first}
    for _ in range(4):  # the first wave is prefilling / decoding when the second wave arrives
        engine.step()
    assert any(seq.output_ids for r in requests.values() for seq in r.seqs)
    requests.update({i: engine.add_request(f"b{i}", prompts[i], _params(i)) for i in second})
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert steps > 0
    for i in range(N_PROMPTS):
        batched = requests[i].output(delta=False).outputs[0]
        assert batched.finish_reason == "length"
        _same(alone[i], batched)


def test_generate_many_prompts_equals_alone(llm):
    prompts = _prompts()
    params = [_params(i) for i in range(N_PROMPTS)]
    together = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 5, 9, 14):
        _same(llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0], together[i].outputs[0])
