"""Weight update sessions (refit): the lifecycle invariant under updates, and what failures leave behind.

Invariant: after any sequence of loads and updates ending with weights W, every resident tensor (derived
ones included) is bit-identical to a fresh load of W, and no tensor address changed since build. Checked
through `weight_report()` checksums and addresses. Engines load the tiny reference config as a native
checkpoint with FP8 dense linears and FP4 experts (the release format), in fp32.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.errors import WeightsNotReadyError, WeightUpdateError

OLD_SEED, NEW_SEED = 1, 2
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 9, 37, 51, 5, 8]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
BUCKETS = 3
SMALL_ENGINE = {"dtype": "float32", "max_num_seqs": 2, "max_model_len": 64}
DERIVED = "hc_attn_fn_broadcast"
E8M0_NAN = 255


@dataclass
class Checkpoints:
    old: Path  # native FP8 dense + FP4 experts, weights OLD_SEED
    new: Path  # the same format, weights NEW_SEED
    new_stored: dict[str, torch.Tensor]  # exactly the tensors of `new` (native names, FP8/FP4 + scales)
    new_hf_bf16: dict[str, torch.Tensor]  # NEW_SEED weights in HF names and layout, bf16
    new_hf_dir: Path  # an HF checkpoint holding new_hf_bf16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Checkpoints:
    root = tmp_path_factory.mktemp("refit")
    cfg = ref.tiny_config()
    old = ref.native_state_dict(ref.build_reference_model(cfg, OLD_SEED))
    new = ref.native_state_dict(ref.build_reference_model(cfg, NEW_SEED))
    ref.write_native_checkpoint(root / "old", cfg, old, dense="fp8", expert_dtype="fp4")
    stored = ref.write_native_checkpoint(root / "new", cfg, new, dense="fp8", expert_dtype="fp4")
    hf = {n: t.to(torch.bfloat16) if t.is_floating_point() else t
          for n, t in ref.hf_state_from_native(new, cfg).items()}
    hf_dir = root / "new_hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    save_file({n: t.contiguous() for n, t in hf.items()}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return Checkpoints(root / "old", root / "new", stored, hf, hf_dir)


def _llm(path, **kwargs) -> LLM:
    return LLM(path, **{**SMALL_ENGINE, **kwargs})


def _checksums(llm: LLM) -> dict[str, str]:
    return {name: t["checksum"] for name, t in llm.weight_report()["tensors"].items()}


def _pointers(llm: LLM) -> dict[str, int]:
    return {name: t["data_ptr"] for name, t in llm.weight_report()["tensors"].items()}


def _state(llm: LLM) -> tuple:
    report = llm.weight_report()
    return report["version"], report["ready"], _checksums(llm), _pointers(llm)


def _logprobs(llm: LLM) -> torch.Tensor:
    return llm.forward_logprobs([PROMPT])[0]


def _greedy(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def _buckets(tensors: dict[str, torch.Tensor], count: int = BUCKETS) -> list[dict[str, torch.Tensor]]:
    """Contiguous runs of the sorted names: boundaries fall wherever they fall, pairs included."""
    names = sorted(tensors)
    size = -(-len(names) // count)
    return [{n: tensors[n] for n in names[i * size : (i + 1) * size]} for i in range(count)]


@dataclass
class Expected:
    """What a fresh load of the new weights holds and answers (computed once)."""

    checksums: dict[str, str]
    logprobs: torch.Tensor
    greedy: list[int]


@pytest.fixture(scope="module")
def fresh_new(ckpts) -> LLM:
    return _llm(ckpts.new)


@pytest.fixture(scope="module")
def new(fresh_new) -> Expected:
    return Expected(_checksums(fresh_new), _logprobs(fresh_new), _greedy(fresh_new))


@pytest.fixture(scope="module")
def old_logprobs(ckpts) -> torch.Tensor:
    return _logprobs(_llm(ckpts.old))


# ---- success paths ----
def test_update_equals_fresh_load_and_moves_no_tensor(ckpts, new):
    llm = _llm(ckpts.old)
    built = _pointers(llm)
    before = _checksums(llm)
    assert {t["derived"] for t in llm.weight_report()["tensors"].values()} == {True, False}
    assert before[DERIVED] != new.checksums[DERIVED], "the derived tensor must need a refresh"

    with llm.begin_weight_update() as session:
        for bucket in _buckets(ckpts.new_stored):
            session.load(bucket)

    report = llm.weight_report()
    assert report["version"] == 1 and report["ready"]
    assert _checksums(llm) == new.checksums
    assert _pointers(llm) == built
    assert torch.equal(_logprobs(llm), new.logprobs)
    assert _greedy(llm) == new.greedy


def test_empty_session_changes_nothing(ckpts):
    llm = _llm(ckpts.old)
    before = _state(llm)
    with llm.begin_weight_update() as session:
        pass
    assert session.state == "finished"
    assert _state(llm) == before


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "fail_stop"])
def test_weights_and_scales_in_different_buckets(ckpts, new, atomic):
    llm = _llm(ckpts.old)
    scales = {n: t for n, t in ckpts.new_stored.items() if n.endswith(".scale")}
    weights = {n: t for n, t in ckpts.new_stored.items() if n not in scales}
    weight_dtypes = {t.dtype for t in weights.values()}
    assert torch.int8 in weight_dtypes and torch.float8_e4m3fn in weight_dtypes
    with llm.begin_weight_update(atomic=atomic) as session:
        session.load(weights)  # every FP8 / FP4 weight waits for its scale
        session.load(scales)
    assert _checksums(llm) == new.checksums


def test_staged_values_do_not_alias_the_callers_buckets(ckpts, new):
    """A trainer reuses its receive buffer for the next bucket: mutating a loaded bucket must not leak in."""
    llm = _llm(ckpts.old)
    bucket = {n: t.clone() for n, t in ckpts.new_stored.items()}
    session = llm.begin_weight_update()
    session.load(bucket)
    for tensor in bucket.values():
        tensor.view(torch.uint8).zero_()
    session.finish()
    assert _checksums(llm) == new.checksums


@pytest.mark.parametrize("kernels", [True, False], ids=["copy_kernels", "no_compiler"])
@pytest.mark.parametrize("layout", ["resident", "trainer"])
def test_atomic_update_in_either_layout_equals_fresh_load(ckpts, fresh_new, new, monkeypatch, layout, kernels):
    """Resident-format tensors (staged and committed as raw bytes by the streaming kernels) and a trainer's
    row-major ones (transposed while staged): the same bytes as a fresh load, and the same where no C
    compiler builds the kernels (torch's copies throughout)."""
    from dsv4.weights import layout_copy

    tensors = [(n, t.clone() if layout == "resident" else t.contiguous()) for n, t in fresh_new.iter_weights()]
    llm = _llm(ckpts.old)
    built = _pointers(llm)
    if not kernels:
        monkeypatch.setattr(layout_copy, "_library", lambda: None)
    llm.update_weights(tensors)
    assert _checksums(llm) == new.checksums and _pointers(llm) == built


def test_hf_named_bf16_update_into_fp4_experts_equals_fresh_hf_load(ckpts):
    llm = _llm(ckpts.old)
    assert llm.loaded.expert_format == "fp4"
    assert any(n.endswith("experts.gate_up_proj") for n in ckpts.new_hf_bf16)
    llm.update_weights(ckpts.new_hf_bf16.items())
    fresh = _llm(ckpts.new_hf_dir, expert_dtype="fp4")
    assert _checksums(llm) == _checksums(fresh)


def test_clone_through_iter_weights(ckpts, fresh_new, new):
    """A dummy-started engine (the usual RL start) becomes bit-identical to a real one and generates alike."""
    other = _llm("dsv4-tiny-dummy", load_format="dummy")
    built = _pointers(other)
    assert _checksums(other) != new.checksums
    version = other.update_weights(fresh_new.iter_weights())
    assert version == 1
    assert _checksums(other) == new.checksums
    assert _pointers(other) == built
    assert _greedy(other) == new.greedy


def test_iter_weights_yields_resident_formats(fresh_new):
    tensors = dict(fresh_new.iter_weights())
    assert tensors["layers.0.ffn.experts.3.w1.weight"].dtype == torch.int8
    assert tensors["layers.0.ffn.experts.3.w1.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.float32
    loadable = fresh_new.loaded.slot_table().names()
    assert {n for n in tensors if not n.endswith(".scale")} == loadable


# ---- failures ----
def _corrupt(bucket: dict[str, torch.Tensor], kind: str) -> str:
    """Put one bad tensor into `bucket`; returns the name the error must mention."""
    if kind == "nan":
        name = next(n for n, t in bucket.items() if t.dtype == torch.bfloat16 and t.numel() > 1)
        bad = bucket[name].clone()
        bad.view(-1)[1] = float("nan")
    elif kind == "nan_scale":
        name = next(n for n, t in bucket.items() if t.dtype == torch.float8_e8m0fnu)
        bad = bucket[name].clone()
        bad.view(torch.uint8).view(-1)[0] = E8M0_NAN
        name = name.removesuffix(".scale")  # reported with its weight
    elif kind == "unknown":
        name, bad = "layers.1.attn.wq_c.weight", torch.zeros(4, 4)
    else:  # wrong shape
        name = next(n for n, t in bucket.items() if t.dtype == torch.bfloat16 and t.dim() == 1)
        bad = torch.zeros(bucket[name].shape[0] + 1, dtype=torch.bfloat16)
    bucket[name if kind != "nan_scale" else f"{name}.scale"] = bad
    return name


@pytest.mark.parametrize("kind", ["nan", "nan_scale", "unknown", "shape"])
def test_atomic_failure_mid_session_keeps_old_weights_serving(ckpts, new, old_logprobs, kind):
    llm = _llm(ckpts.old)
    before = _state(llm)
    buckets = _buckets(ckpts.new_stored)
    bad_name = _corrupt(buckets[1], kind)
    session = llm.begin_weight_update()
    session.load(buckets[0])
    with pytest.raises(WeightUpdateError, match=rf"update bucket 2.*{re.escape(bad_name)}"):
        session.load(buckets[1])
    assert _state(llm) == before
    assert torch.equal(_logprobs(llm), old_logprobs)
    with pytest.raises(WeightUpdateError, match="already failed"):
        session.load(buckets[2])
    llm.update_weights(ckpts.new_stored.items())  # the next session starts clean
    assert _checksums(llm) == new.checksums


@pytest.mark.parametrize("layout", ["trainer", "resident"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_atomic_update_checks_values_while_staging(ckpts, fresh_new, old_logprobs, layout, bad):
    """Atomic sessions check float values in the same pass that stages them (a transposing copy for
    row-major trainer tensors, a straight one for resident-format tensors): a non-finite value anywhere is
    refused with the tensor's name, and the previous weights keep serving, bit for bit."""
    llm = _llm(ckpts.old)
    before = _state(llm)
    tensors = dict(fresh_new.iter_weights())
    name = "layers.1.attn.wq_a.weight"  # an fp32 input-major dense weight
    value = tensors[name].contiguous() if layout == "trainer" else tensors[name].clone()
    value[-1, -1] = bad  # the last row and column: where no register block reaches in most shapes
    tensors[name] = value
    with pytest.raises(WeightUpdateError, match=rf"{re.escape(name)}.*1 non-finite value"):
        llm.update_weights(tensors.items())
    assert _state(llm) == before
    assert torch.equal(_logprobs(llm), old_logprobs)


def test_abort_and_exception_keep_old_weights(ckpts, old_logprobs):
    llm = _llm(ckpts.old)
    before = _state(llm)
    buckets = _buckets(ckpts.new_stored)
    session = llm.begin_weight_update()
    session.load(buckets[0])
    session.load(buckets[1])
    with pytest.raises(WeightUpdateError, match="already open"):
        llm.begin_weight_update()
    session.abort()
    assert _state(llm) == before
    with pytest.raises(KeyboardInterrupt):
        with llm.begin_weight_update() as second:
            second.load(buckets[0])
            raise KeyboardInterrupt
    assert second.state == "aborted"
    assert _state(llm) == before
    assert torch.equal(_logprobs(llm), old_logprobs)


def test_full_session_rejects_missing_tensors(ckpts):
    llm = _llm(ckpts.old)
    before = _state(llm)
    dropped = "layers.3.ffn.experts.7.w2.weight"
    partial = {n: t for n, t in ckpts.new_stored.items() if not n.startswith(dropped.removesuffix(".weight"))}
    with pytest.raises(WeightUpdateError, match=rf"1 missing tensor\(s\): {re.escape(dropped)}"):
        with llm.begin_weight_update(full=True) as session:
            session.load(partial)
    assert _state(llm) == before


def test_weight_without_its_scale_is_rejected_at_finish(ckpts):
    llm = _llm(ckpts.old)
    before = _state(llm)
    name = "layers.2.attn.wo_a.weight"
    with pytest.raises(WeightUpdateError, match=rf"{re.escape(name)} \(from update bucket 1\) has no scale"):
        llm.update_weights([(name, ckpts.new_stored[name])])
    assert _state(llm) == before


def test_fail_stop_failure_refuses_requests_until_a_complete_update(ckpts, new):
    llm = _llm(ckpts.old)
    built = _pointers(llm)
    buckets = _buckets(ckpts.new_stored)
    bad_name = _corrupt(buckets[1], "nan")
    session = llm.begin_weight_update(atomic=False)
    session.load(buckets[0])
    assert not llm.weight_report()["ready"]  # written in place: a mix until finish
    with pytest.raises(WeightUpdateError, match=re.escape(bad_name)):
        session.load(buckets[1])
    with pytest.raises(WeightsNotReadyError, match="target model"):
        llm.generate([PROMPT], GREEDY)

    # a partial update cannot vouch for the half-written rest
    with pytest.raises(WeightUpdateError, match="missing tensor"):
        with llm.begin_weight_update(atomic=False) as partial:
            partial.load(buckets[0])
    with pytest.raises(WeightsNotReadyError, match="target model"):
        llm.forward_logprobs([PROMPT])

    with llm.begin_weight_update(atomic=False) as complete:
        for bucket in _buckets(ckpts.new_stored):
            complete.load(bucket)
    report = llm.weight_report()
    assert report["ready"] and report["version"] == 1
    assert _checksums(llm) == new.checksums
    assert _pointers(llm) == built
    assert torch.equal(_logprobs(llm), new.logprobs)


def test_fail_stop_error_before_any_write_still_stops_serving(ckpts):
    """Fail-stop means the caller's update failed: the engine refuses requests rather than serve weights
    the trainer believes replaced, even when the bad tensor came first."""
    llm = _llm(ckpts.old)
    bucket = dict(_buckets(ckpts.new_stored)[0])
    _corrupt(bucket, "unknown")
    with pytest.raises(WeightUpdateError, match="unexpected tensor"):
        with llm.begin_weight_update(atomic=False) as session:
            session.load(bucket)
    assert not llm.weight_report()["ready"]
    with pytest.raises(WeightsNotReadyError, match="target model"):
        llm.forward_logprobs([PROMPT])


def test_atomic_commit_interrupted_mid_write_stops_serving(ckpts, monkeypatch):
    """If writing the staged values fails part-way (it cannot after validation, short of a device error),
    the models hold a mix: they must refuse requests, not serve it."""
    from dsv4.weights.writer import WeightWriter

    llm = _llm(ckpts.old)
    real_write, real_write_raw, calls = WeightWriter._write, WeightWriter._write_raw, []

    def failing_write(self, dest, value):
        calls.append(dest)
        if len(calls) > BUCKETS:
            raise RuntimeError("device lost")
        real_write(self, dest, value)

    def failing_write_raw(self, copies):  # the staged buffers laid out like their weights: one call for all
        real_write_raw(self, copies[: len(copies) // 2])
        raise RuntimeError("device lost")

    monkeypatch.setattr(WeightWriter, "_write", failing_write)
    monkeypatch.setattr(WeightWriter, "_write_raw", failing_write_raw)
    with pytest.raises(WeightUpdateError, match="device lost"):
        llm.update_weights(ckpts.new_stored.items())
    assert not llm.weight_report()["ready"]
    with pytest.raises(WeightsNotReadyError, match="target model"):
        llm.forward_logprobs([PROMPT])


def test_pointer_audit_rejects_an_update_that_moves_a_tensor(ckpts, monkeypatch):
    """A write that rebinds instead of copying in place would leave captured graphs reading old storage."""
    from dsv4.weights.writer import WeightWriter

    llm = _llm(ckpts.old)
    moved = "layers.1.attn.wq_a.weight"
    param = llm.loaded.slot_table().get(moved).resident
    real_write, real_write_raw = WeightWriter._write, WeightWriter._write_raw

    def rebinding_write(self, dest, value):
        if dest is not param:
            return real_write(self, dest, value)
        param.data = value.to(param.dtype).clone()  # the classic refit bug: a new storage

    def rebinding_write_raw(self, copies):  # the commit's one call for the buffers laid out like their weights
        done = real_write_raw(self, copies)
        param.data = param.detach().clone()
        return done

    monkeypatch.setattr(WeightWriter, "_write", rebinding_write)
    monkeypatch.setattr(WeightWriter, "_write_raw", rebinding_write_raw)
    with pytest.raises(WeightUpdateError, match=rf"moved 1 tensor\(s\) to a new address: target:{re.escape(moved)}"):
        llm.update_weights(ckpts.new_stored.items())
    assert not llm.weight_report()["ready"]


def test_refit_ends_requests_in_flight():
    """Cache state computed with the old weights is never continued under the new ones."""
    llm = LLM("dsv4-tiny-dummy", load_format="dummy", seed=1, dtype="float32")
    donor = LLM("dsv4-tiny-dummy", load_format="dummy", seed=2, dtype="float32")
    stream = llm.stream([[3, 4, 5]], SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(stream)
    assert not first.finished and first.weights_version == 0
    llm.update_weights(donor.iter_weights())
    rest = list(stream)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    after = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert after[0].weights_version == 1
    expected = donor.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert after[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


# ---- cost structure: what a refit does per tensor ----
def _count_calls(monkeypatch, owner, name: str) -> list:
    calls = []
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def test_names_are_planned_once_per_model(ckpts, monkeypatch):
    """A refit resolves names by lookup: the rename rules run once per spelling per model (the first update
    in HF names), never again; no update walks modules to find a parameter."""
    import dsv4.weights.routes as routes_module
    from dsv4.weights.slots import SlotTable

    llm = _llm(ckpts.old)
    renames = _count_calls(monkeypatch, routes_module, "canonical_name")
    tables = _count_calls(monkeypatch, SlotTable, "__init__")
    walks = _count_calls(monkeypatch, torch.nn.Module, "get_submodule")
    llm.update_weights(ckpts.new_hf_bf16.items())
    first = len(renames)
    assert 0 < first <= len(ckpts.new_hf_bf16)
    llm.update_weights(ckpts.new_hf_bf16.items())
    llm.update_weights(ckpts.new_stored.items())  # native spellings never need the rules
    assert len(renames) == first
    assert tables == []
    assert [target for _, target in walks if target] == []  # (finalize looks up its own buffers by name)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "fail_stop"])
def test_resident_format_update_makes_no_extra_copy(ckpts, monkeypatch, atomic):
    """Tensors already in the resident format: fail-stop writes them straight into place (no copy, no
    allocation); atomic stages each once (one buffer per tensor), and neither clones anything."""
    source = _llm(ckpts.new)
    tensors = [(name, t.clone()) for name, t in source.iter_weights()]
    llm = _llm(ckpts.old)
    from dsv4.weights.writer import WeightWriter

    clones = _count_calls(monkeypatch, torch.Tensor, "clone")
    buffers = _count_calls(monkeypatch, WeightWriter, "_staging_buffer")
    with llm.begin_weight_update(atomic=atomic) as session:
        session.load(tensors)
        loading = (len(clones), len(buffers))
    assert loading == (0, len(tensors) if atomic else 0)
    assert _checksums(llm) == _checksums(source)


def test_atomic_updates_reuse_their_staging_buffers(ckpts):
    """The second atomic update of the same tensors stages into the buffers the first allocated (no new
    memory mapped), and still ends bit for bit as a fresh load; clear() gives the buffers back."""
    old = [(name, t.clone()) for name, t in _llm(ckpts.old).iter_weights()]
    new = [(name, t.clone()) for name, t in _llm(ckpts.new).iter_weights()]
    llm = _llm(ckpts.old)
    staging = llm.loaded.staging
    llm.update_weights(new)
    kept, mapped = staging.nbytes, staging._memory.mapped_bytes
    assert kept >= sum(t.nbytes for _, t in new)
    llm.update_weights(old)
    llm.update_weights(new)
    assert (staging.nbytes, staging._memory.mapped_bytes) == (kept, mapped)
    assert _checksums(llm) == _checksums(_llm(ckpts.new))
    with llm.begin_weight_update() as session:  # no release while a session may be staging into them
        with pytest.raises(WeightUpdateError, match="session is open"):
            llm.release_weight_staging()
        session.load(old)
    assert llm.release_weight_staging() == kept
    assert staging.nbytes == 0 and llm.release_weight_staging() == 0
    llm.update_weights(new)  # allocates again
    assert staging.nbytes == kept and _checksums(llm) == _checksums(_llm(ckpts.new))


def test_trainer_parameters_that_require_grad(ckpts):
    """A trainer hands over its live parameters: their values go in, no autograd graph comes along."""
    llm = _llm(ckpts.old)
    live = {n: t.float().requires_grad_() if t.is_floating_point() else t for n, t in ckpts.new_hf_bf16.items()}
    llm.update_weights(live.items())
    assert not any(p.requires_grad or p.grad_fn is not None for p in llm.loaded.target.parameters())
    assert _checksums(llm) == _checksums(_llm(ckpts.new_hf_dir, expert_dtype="fp4"))


@pytest.mark.parametrize("shape", [(130, 2050), (64, 1024), (3000, 70), (1, 5), (7, 1)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16)], ids=["fp32", "bf16_to_fp32", "fp32_to_bf16"])
def test_copy_into_an_input_major_weight(shape, dtypes):
    """Row-major values into an input-major resident weight (tile by tile, several tiles and ragged edges
    here): the values torch's own copy gives, in the same storage."""
    from dsv4.weights.convert import copy_into

    incoming, resident = dtypes
    value = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(incoming)
    dest = torch.zeros(shape[1], shape[0], dtype=resident).t()
    ptr = dest.data_ptr()
    copy_into(dest, value)
    assert dest.data_ptr() == ptr and dest.stride() == (1, shape[0])
    assert torch.equal(dest, value.to(resident))
    copy_into(dest, value.t().contiguous().t())  # already input-major: a straight copy
    assert torch.equal(dest, value.to(resident))


def test_native_spellings_resolve_without_rename_rules(tmp_path):
    """The route table resolves a native name (with or without `model.`) and its `.scale` by lookup alone;
    that is only sound if the rename rules leave every native name of every model unchanged."""
    from dsv4.config import ModelConfig
    from dsv4.weights.loader import build_models
    from dsv4.weights.names import canonical_name
    from dsv4.weights.slots import SlotTable

    dspark = {"dspark_block_size": 5, "dspark_noise_token_id": 3, "dspark_target_layer_ids": [1, 3],
              "dspark_markov_rank": 8, "n_mtp_layers": 2}
    names = set()
    for draft, extra in (("mtp", {}), ("dspark", dspark)):
        (tmp_path / draft).mkdir()
        (tmp_path / draft / "config.json").write_text(json.dumps(dict(ref.tiny_config(), **extra)))
        config = ModelConfig.from_file(tmp_path / draft)
        for experts in ("dense", "fp4"):
            names |= SlotTable(build_models(config, experts, torch.float32, "meta", draft)).names()
    assert any(n.startswith("mtp.") for n in names) and any(".experts." in n for n in names)
    for native in sorted(names):
        scale = native.removesuffix(".weight") + ".scale"
        for spelling in (native, f"model.{native}"):
            assert canonical_name(spelling) == native, spelling
        assert canonical_name(scale) == scale


def test_dry_run_checks_names_shapes_and_pairs_from_headers_alone(ckpts, monkeypatch):
    """`WeightWriter(dry_run=True)` on meta tensors built from safetensors headers (what `dsv4 inspect`
    does): a good checkpoint is complete; a bad one reports every problem, one per tensor; nothing is read
    and nothing is written."""
    from dsv4.errors import CheckpointError
    from dsv4.weights.checkpoint import TORCH_DTYPES, CheckpointDir
    from dsv4.weights.writer import WeightWriter

    llm = _llm(ckpts.old)
    before = _state(llm)
    monkeypatch.setattr("dsv4.weights.checkpoint.map_file", lambda *a, **k: pytest.fail("the dry run read data"))

    def dry_run(infos) -> tuple[WeightWriter, list[str]]:
        writer = WeightWriter(llm.loaded.routes(), llm.loaded.layout, dry_run=True)
        problems = []
        for info in infos:
            meta = torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype], device="meta")
            try:
                writer.load(info.name, meta, str(info.file))
            except CheckpointError as exc:
                problems.append(str(exc))
        return writer, problems

    infos = list(CheckpointDir(ckpts.new).tensors.values())
    writer, problems = dry_run(infos)
    assert problems == [] and writer.unpaired() == []
    writer.check_complete(llm.loaded.slot_table().names(), "dry run")

    def mutated(info, **changes):
        return info._replace(**changes)  # header entries are named tuples

    by_name = {info.name: info for info in infos}
    bad = [info for info in infos if info.name not in ("layers.1.attn.wq_a.scale", "norm.weight")]
    bad += [mutated(by_name["norm.weight"], shape=(7,)), mutated(by_name["norm.weight"], name="layers.1.attn.bogus")]
    writer, problems = dry_run(bad)
    assert len(problems) == 2
    assert "norm.weight" in problems[0] + problems[1] and "layers.1.attn.bogus" in problems[0] + problems[1]
    wq_a = by_name["layers.1.attn.wq_a.weight"]
    assert writer.unpaired() == [f"layers.1.attn.wq_a.weight (from {wq_a.file}) has no scale"]
    assert "norm.weight" in llm.loaded.slot_table().names() - writer.written
    assert _state(llm) == before
