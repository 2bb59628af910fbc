"""The replayed decode step (`engine/decode_replay.py`, `kernels/native_calls.py`): bit for bit the eager step
(logits, streams and every cache tensor) in every expert format, with 1 to 3 rows in scattered slots that change
between steps and every compressor window completing; a refit reaches it; a forward that runs torch ops is never
recorded; a step outside the cache is refused before any kernel runs."""

import ctypes

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.engine.model_runner import Chunk, ModelRunner
from dsv4.kernels.gemv_cpu import shared_kernels
from dsv4.kernels.native_calls import Replay, bind_packed, native_call, recording
from dsv4.kernels.norm_rope_cpu import NormRopeKernel, build_library
from dsv4.model.cache import cache_tensors
from dsv4.model.linear import input_major

SEED, NEW_SEED = 5, 6
# Every layer kind and both routers: CSA (m=4, with the indexer), HCA (m=16), sliding; hash and learned MoE.
CONFIG = ref.tiny_config(num_hidden_layers=5, layer_types=["sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                         mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"])
FORMATS = ("dense", "fp8", "fp4")
LIMITS = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 96}
# Decode steps per sequence: from the prompts' ends past two HCA windows (16 positions each).
STEPS = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """expert format -> (old weights, new weights) native checkpoints."""
    root = tmp_path_factory.mktemp("decode_replay")
    dirs = {}
    for fmt in FORMATS:
        for name, seed in (("old", SEED), ("new", NEW_SEED)):
            state = ref.native_state_dict(ref.build_reference_model(CONFIG, seed))
            if fmt == "dense":
                ref.write_native_checkpoint(root / fmt / name, CONFIG, state)
            else:
                ref.write_native_checkpoint(root / fmt / name, CONFIG, state, dense="fp8", expert_dtype=fmt)
        dirs[fmt] = (str(root / fmt / "old"), str(root / fmt / "new"))
    return dirs


# The slots each decode step runs, in order: one, two or three rows in scattered slots; each row count gets its own
# record, and its later steps put other slots (and positions) in its rows than the step that recorded it.
SCHEDULE = ([2], [3, 0, 2], [0, 3], [3], [0, 2, 3], [2, 0])


def _decode(runner: ModelRunner, prompts: dict[int, list[int]],
            schedule: tuple[list[int], ...] = SCHEDULE) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Each slot's prompt prefilled, then STEPS greedy decode steps over the slots of `schedule` in turn (each asking
    for the argmax of its rows): each step's (streams, logits, argmax)."""
    tokens, positions = {}, {}
    for slot, prompt in prompts.items():
        result = runner.execute([Chunk(slot, prompt, 0)], logit_rows=[len(prompt) - 1])
        tokens[slot], positions[slot] = int(result.logits[0].argmax()), len(prompt)
    steps = []
    for step in range(STEPS):
        slots = schedule[step % len(schedule)]
        chunks = [Chunk(slot, [tokens[slot]], positions[slot]) for slot in slots]
        with runner.step_threads(chunks):
            result = runner.execute(chunks, logit_rows=list(range(len(chunks))), argmax=True)
        # Copies: a result is valid until the next step (a replayed step returns its record's buffers).
        steps.append((result.streams.clone(), result.logits.clone(),
                      None if result.argmax is None else result.argmax.clone()))
        for slot, row in zip(slots, result.logits.argmax(-1).tolist(), strict=True):
            tokens[slot], positions[slot] = row, positions[slot] + 1
    return steps


# Row counts 1, 1, 2, 2, 1, 1, 3, 1 (then again): with two records, the 3-row step drops the 2-row record (used
# less recently than the 1-row one), and the next 2-row step records again.
LRU_SCHEDULE = ([2], [2], [0, 3], [0, 3], [2], [2], [3, 0, 2], [2])


def test_records_beyond_the_limit_drop_the_least_recently_used(checkpoints):
    """Three row counts through a replay that keeps two records: each step equals the eager step, at most two records
    are kept, the least recently used is the one dropped, and the steps whose record was kept are replayed."""
    llm = LLM(checkpoints["fp4"][0], **LIMITS)
    model, limits = llm.loaded.target, llm.engine.limits
    replaying, eager = ModelRunner(model, limits), ModelRunner(model, limits, replay_decode=False)
    replaying.replay.max_records = 2
    prompts = {slot: [5 + slot, 9, 14, 3] for slot in (0, 2, 3)}
    got, want = _decode(replaying, prompts, LRU_SCHEDULE), _decode(eager, prompts, LRU_SCHEDULE)
    for (streams, logits, _), (streams_ref, logits_ref, _) in zip(got, want, strict=True):
        assert torch.equal(streams, streams_ref) and torch.equal(logits, logits_ref)
    assert replaying.replay.recorded_rows == (3, 1)  # after the 8th step: the 2-row record dropped, 1 used last
    # Per 8 steps: the first cycle records 1, 2, 3 (and 2 again in every later cycle, then 3 again); the rest replay.
    cycles, rest = divmod(STEPS, len(LRU_SCHEDULE))
    assert replaying.replay.replayed_steps == STEPS - 3 - 2 * (cycles - 1) - (1 if rest >= 3 else 0)


@pytest.mark.parametrize("fmt, dtype, activations", [(fmt, "float32", None) for fmt in FORMATS]
                         + [("dense", "bfloat16", None), ("dense", "bfloat16", "float32")])
def test_replayed_steps_equal_eager_steps_bit_for_bit(checkpoints, fmt, dtype, activations):
    """Two runners on one model, one replaying: every step's streams and logits and, after, every cache tensor
    are identical; the replay was used (a record of the model's kernel calls per row count, none refused). bf16
    weights under fp32 activations take their embedding rows from torch's lookup, the others from the replay's
    gather call."""
    llm = LLM(checkpoints[fmt][0], **{**LIMITS, "dtype": dtype, "activation_dtype": activations})
    model = llm.loaded.target
    limits = llm.engine.limits
    replaying, eager = ModelRunner(model, limits), ModelRunner(model, limits, replay_decode=False)
    g = torch.Generator().manual_seed(SEED)
    prompts = {slot: torch.randint(2, 512, (n,), generator=g).tolist() for slot, n in ((2, 9), (0, 3), (3, 14))}
    got, want = _decode(replaying, prompts), _decode(eager, prompts)
    assert replaying.replay.refused is None
    assert all(replaying.replay.recorded_calls(rows) > 0 for rows in (1, 2, 3))
    first = {replaying.replay.recorded_kernels(rows)[0] for rows in (1, 2, 3)}
    assert (first == {"gather_rows"}) == (activations is None), first
    for (streams, logits, argmax), (streams_ref, logits_ref, argmax_ref) in zip(got, want, strict=True):
        assert torch.equal(streams, streams_ref) and torch.equal(logits, logits_ref)
        # The replay's argmax (fp32 logits: the argmax kernel's) is the sampler's greedy pick; eager steps leave it.
        assert argmax_ref is None
        if "float32" in (dtype, activations):
            assert torch.equal(argmax, logits.max(dim=-1).indices)
        else:
            assert argmax is None
    for mine, theirs in zip(cache_tensors(replaying.cache.layers), cache_tensors(eager.cache.layers), strict=True):
        assert torch.equal(mine, theirs)


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


def test_a_refit_reaches_the_replayed_step(checkpoints):
    """After a refit the engine's decode steps generate what a fresh load of the new weights generates (the record
    is made again for the new weights generation)."""
    old_dir, new_dir = checkpoints["fp4"]
    prompt = [[5, 9, 14, 3]]
    llm = LLM(old_dir, **LIMITS)
    before = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    replay = llm.engine.runner.replay
    assert replay.recorded_calls() > 0
    fresh = LLM(new_dir, **LIMITS)
    llm.update_weights(fresh.iter_weights())
    after = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert after != before
    assert after == fresh.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert replay.recorded_calls() > 0 and replay.refused is None


def test_a_forward_that_runs_torch_ops_is_not_recorded(checkpoints):
    """With one MoE layer's fused kernel unbound, the decode forward runs the router in torch: the records are refused
    (naming the ops), the steps stay eager and equal a runner that never replays, and no step records again."""
    llm = LLM(checkpoints["dense"][0], **LIMITS)
    model = llm.loaded.target
    model.layers[2].ffn.layer_kernel = None
    replaying = ModelRunner(model, llm.engine.limits)
    eager = ModelRunner(model, llm.engine.limits, replay_decode=False)
    prompts = {slot: [7, 8, 9 + slot] for slot in (0, 2, 3)}
    got, want = _decode(replaying, prompts), _decode(eager, prompts)
    assert all(replaying.replay.recorded_calls(rows) == 0 for rows in (1, 2, 3))
    assert "torch ops" in replaying.replay.refused
    assert not replaying.replay.serves([Chunk(1, [3], 50)], ())
    for (streams, logits, _), (streams_ref, logits_ref, _) in zip(got, want, strict=True):
        assert torch.equal(streams, streams_ref) and torch.equal(logits, logits_ref)


@pytest.mark.parametrize("replay_decode", [True, False], ids=["replayed", "eager"])
def test_a_step_outside_the_cache_is_refused_before_any_kernel_runs(checkpoints, replay_decode):
    """A slot past the cache's, a negative slot or position: a clear error, and the cache is untouched (the kernels
    would index it out of bounds)."""
    llm = LLM(checkpoints["dense"][0], **LIMITS)
    runner = ModelRunner(llm.loaded.target, llm.engine.limits, replay_decode=replay_decode)
    runner.execute([Chunk(0, [5, 6], 0)], logit_rows=[1])
    before = [t.clone() for t in cache_tensors(runner.cache.layers)]
    for chunk, message in ((Chunk(4, [7], 0), "cache slot 4 outside the cache's 4 slots"),
                           (Chunk(-1, [7], 0), "cache slot -1 outside"),
                           (Chunk(0, [7], -1), "cannot start at negative position -1")):
        with pytest.raises(ValueError, match=message):
            runner.execute([chunk], logit_rows=[0])
    assert all(torch.equal(a, b) for a, b in zip(before, cache_tensors(runner.cache.layers), strict=True))
    assert runner.cache.lengths[0] == 2


def test_a_replay_repeats_the_recorded_calls_and_their_status_checks():
    """Recorded calls made again act on the same memory as the first time (the rows rotated twice), and a call whose
    status was an error raises that error again when replayed."""
    kernel = NormRopeKernel(build_library())
    x = torch.randn(2, 3, 8)
    positions = torch.tensor([3, 7])
    inv_freq = torch.rand(4)
    expected = x.clone()
    with recording() as calls:
        kernel(x, None, None, positions, inv_freq)
    kernel(expected, None, None, positions, inv_freq)
    kernel(expected, None, None, positions, inv_freq)
    Replay(calls).run()
    assert len(calls) == 1 and torch.equal(x, expected)
    kernel(expected, None, None, positions, inv_freq)
    Replay(calls).run_call(0)  # one call alone, as a profile makes it (benchmarks/profile_decode.py)
    assert Replay(calls).kernels == ("norm_rope",) and torch.equal(x, expected)

    weight = input_major(8, 16, torch.float32)
    weight.copy_(torch.randn(8, 16))
    product = shared_kernels()[0].bind(weight)
    rows = torch.randn(1, 16)
    with recording() as product_calls:
        y = product(rows)
    fn, args = product_calls[0].fn, product_calls[0].args
    with recording() as failed, pytest.raises(ValueError, match="dense_xw: arguments outside"):
        native_call(fn, (*args[:6], 99, *args[7:]), product_calls[0].check, "dense_xw")  # 99: no weight format
    with pytest.raises(ValueError, match="dense_xw: arguments outside"):
        Replay(failed).run()
    assert torch.equal(y, product(rows))


def test_a_packed_twin_that_reads_other_arguments_than_its_kernel_declares_is_refused():
    """The replay calls each kernel through a twin that reads its arguments from a block by the letters it
    declares (packed_call.h); a kernel declared with other argument types is refused when bound, naming both."""
    lib = ctypes.CDLL(build_library()._name)  # its own function objects: the shared library's stay as they are
    lib.norm_rope.argtypes = [ctypes.c_void_p] * 11
    with pytest.raises(RuntimeError, match=r"norm_rope_packed reads its arguments as 'pilllfpppli' but norm_rope is "
                                           r"declared with 'ppppppppppp'"):
        bind_packed(lib, ("norm_rope",))
    lib.norm_rope.argtypes = build_library().norm_rope.argtypes
    bind_packed(lib, ("norm_rope",))
    assert lib.norm_rope.packed == ctypes.cast(lib.norm_rope_packed, ctypes.c_void_p).value
