"""A weight update reaches the MTP drafter in the same session as the target (peers' bug: SGLang #27718, vime PR
#351, miles PR #1926: a drafter left stale by an update drafts for the old weights, and acceptance silently falls).

An engine started on dummy weights (target and drafter random) is refit with the embedded `dsv4-sort`'s trained
weights, in native names and in HF names (the target's transformers spelling, the drafter's `model.`-prefixed
`mtp.*` names); its greedy outputs and speculation metrics then equal those of a fresh load of `dsv4-sort`, exactly.
A refit of the target alone leaves the random drafter: the tokens are still right (speculation is exact) but
acceptance falls far below, so the comparison can fail.
"""

from __future__ import annotations

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.tasks import sort_digits as task
from dsv4.weights.names import to_hf_name

MODEL = "dsv4-sort"
K = 3


def _llm(**kwargs) -> LLM:
    return LLM(MODEL, dtype="float32", draft="mtp", num_speculative_tokens=K, max_num_seqs=4, **kwargs)


def _run(llm: LLM):
    prompts = [ex.prompt for ex in task.examples(12, 7)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine.speculation


@pytest.fixture(scope="module")
def fresh():
    llm = _llm()
    weights = [(name, tensor.clone()) for name, tensor in llm.iter_weights()]
    return weights, _run(llm)


def _hf(name: str) -> str:
    return "model." + name if name.startswith("mtp.") else to_hf_name(name)


@pytest.mark.parametrize("names", ["native", "hf"])
def test_refit_updates_the_drafter_too(fresh, names):
    weights, (tokens, metrics) = fresh
    assert any(n.startswith("mtp.") for n, _ in weights)
    llm = _llm(load_format="dummy")
    assert _run(llm)[1].accepted_tokens < metrics.accepted_tokens / 2  # random weights: a poor drafter
    llm.engine.speculation = type(metrics)()  # count the refit's run alone
    pairs = weights if names == "native" else [(_hf(n), t) for n, t in weights]
    llm.update_weights(pairs, full=True)
    assert _run(llm) == (tokens, metrics)


def test_a_refit_that_skips_the_drafter_lowers_acceptance(fresh):
    weights, (tokens, metrics) = fresh
    llm = _llm(load_format="dummy")
    llm.update_weights([(n, t) for n, t in weights if not n.startswith("mtp.")])
    llm.engine.speculation = type(metrics)()
    stale_tokens, stale = _run(llm)
    assert stale_tokens == tokens  # speculation stays exact with any drafter
    assert stale.acceptance_rate < metrics.acceptance_rate / 2
