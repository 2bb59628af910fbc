"""Lifecycle conformance matrix: {target, mtp, dspark} x {dummy, HF, native FP4, native FP8, in-memory refit}.

Every cell checks what the lifecycle contract promises: the model holds what the checkpoint stores (the
files are the reference); the model generates; every derived tensor equals its recomputation from the
live weights; an empty refit session changes nothing; a refit with the cell's weights ends bit-identical
to a fresh load of them; no tensor address moves.
`scripts/check_mutations.py` re-runs this file against broken copies of the lifecycle code.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_reference import released_dspark_tensors, released_storage
from dsv4 import LLM, SamplingParams
from dsv4.engine import dspark_draft
from dsv4.errors import WeightsNotReadyError
from dsv4.model.batch import ForwardBatch
from dsv4.model.linear import Linear
from dsv4.model.moe import DENSE, RoutedExperts
from dsv4.weights.loader import build_models
from reference import (
    build_reference_model,
    native_state_dict,
    random_mtp_tensors,
    save_hf_checkpoint,
    tiny_config,
    write_native_checkpoint,
)

DUMMY_MODEL = "dsv4-tiny-dummy"
ROLES = ("target", "mtp", "dspark")
FORMATS = ("dummy", "hf", "native_fp4", "native_fp8", "refit")
DSPARK_FIELDS = {
    "dspark_block_size": 5, "dspark_noise_token_id": 7, "dspark_target_layer_ids": [1, 3], "dspark_markov_rank": 8,
    "n_mtp_layers": 2,
}
# expert format each checkpoint format loads into
EXPERTS = {"dummy": "fp4", "hf": "dense", "native_fp4": "fp4", "native_fp8": "fp8", "refit": "fp4"}
# the native checkpoint whose stored tensors a cell's model must hold
STORED_IN = {"native_fp4": "native_fp4", "native_fp8": "native_fp8", "refit": "native_fp4"}


def _read_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _dspark_config_dir(root: Path, cfg: dict, quant: str | None) -> Path:
    raw = dict(cfg, **DSPARK_FIELDS, torch_dtype="float32")
    if quant is not None:
        raw["quantization_config"] = {
            "quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": quant,
        }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw))
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, format) -> checkpoint dir. family "mtp" checkpoints carry target + mtp.* tensors; family
    "dspark" ones carry target + the DSpark drafter under its released names and dtypes, written here by
    hand (never through dsv4's exporter, which could only round-trip dsv4's own spelling)."""
    root = tmp_path_factory.mktemp("lifecycle")
    cfg = tiny_config()
    ref = build_reference_model(cfg, seed=11)
    native = native_state_dict(ref)
    native.update(random_mtp_tensors(cfg, seed=12))
    dirs = {}
    hf = root / "mtp_hf"
    save_hf_checkpoint(ref, hf)
    save_file({k: v.contiguous() for k, v in native.items() if k.startswith("mtp.")}, str(hf / "mtp.safetensors"))
    dirs["mtp", "hf"] = hf
    write_native_checkpoint(root / "mtp_fp4", cfg, native, dense="fp8", expert_dtype="fp4")
    dirs["mtp", "native_fp4"] = root / "mtp_fp4"
    write_native_checkpoint(root / "mtp_fp8", cfg, native, dense="fp8", expert_dtype="fp8", scale_fmt="float")
    dirs["mtp", "native_fp8"] = root / "mtp_fp8"
    dirs["mtp", "dummy"] = dirs["mtp", "native_fp4"]

    dspark_cfg = dict(cfg, **DSPARK_FIELDS)
    drafter = released_dspark_tensors(dspark_cfg, seed=13)
    hf = root / "dspark_hf"  # transformers' save of the target; the drafter keeps its native names
    save_hf_checkpoint(ref, hf)
    hf_config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(hf_config, **DSPARK_FIELDS)))
    save_file({k: v.contiguous() for k, v in drafter.items()}, str(hf / "dspark.safetensors"))
    dirs["dspark", "hf"] = hf
    target_only = {name: t for name, t in native.items() if not name.startswith("mtp.")}
    for fmt, experts, scale_fmt in (("native_fp4", "fp4", "ue8m0"), ("native_fp8", "fp8", "float")):
        out = root / f"dspark_{fmt}"
        write_native_checkpoint(out, dspark_cfg, target_only, dense="fp8", expert_dtype=experts, scale_fmt=scale_fmt)
        save_file(released_storage(drafter, experts), str(out / "dspark.safetensors"))
        dirs["dspark", fmt] = out
    dirs["dspark", "dummy"] = _dspark_config_dir(root / "dspark_dummy", cfg, "fp4")
    return dirs


def _family(role: str) -> str:
    return "dspark" if role == "dspark" else "mtp"


def _draft(role: str) -> str | None:
    return None if role == "target" else role


def _load(checkpoints, role: str, fmt: str) -> LLM:
    family, draft = _family(role), _draft(role)
    if fmt == "dummy":
        return LLM(checkpoints[family, "dummy"], load_format="dummy", draft=draft, seed=3, dtype="float32")
    if fmt == "refit":
        llm = LLM(checkpoints[family, "dummy"], load_format="dummy", draft=draft, seed=4, dtype="float32")
        llm.update_weights(_read_dir(checkpoints[family, "native_fp4"]).items())
        return llm
    return LLM(checkpoints[family, fmt], draft=draft, dtype="float32")


def _fresh_equivalent(checkpoints, role: str, fmt: str) -> LLM:
    """A fresh load of the weights the cell ends with."""
    if fmt == "refit":
        return LLM(checkpoints[_family(role), "native_fp4"], draft=_draft(role), dtype="float32")
    return _load(checkpoints, role, fmt)


def _checksums(llm: LLM) -> dict[str, str]:
    return {name: t["checksum"] for name, t in llm.weight_report()["tensors"].items()}


def _pointers(llm: LLM) -> dict[str, int]:
    return {name: t["data_ptr"] for name, t in llm.weight_report()["tensors"].items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _assert_holds_checkpoint(llm: LLM, path: Path) -> None:
    """Every tensor the checkpoint stores in the format the model keeps (quantized experts and their scales,
    routing tables, float tensors) is in the model bit for bit; float tensors stored narrower (bf16) hold
    exactly their widened values. Only FP8 dense linears, dequantized at load, are not compared here."""
    resident = dict(llm.iter_weights())
    compared = set()
    for name, stored in _read_dir(path).items():
        mine = resident.get(name)
        if mine is None or (stored.dtype == torch.float8_e4m3fn and mine.dtype != stored.dtype):
            continue
        if mine.dtype == stored.dtype:
            assert torch.equal(_bits(mine), _bits(stored)), name
        else:
            assert torch.equal(mine, stored.to(mine.dtype)), name
        compared.add(name)
    assert any(".experts." in n for n in compared) and any(n.endswith("tid2eid") for n in compared)


def _dense_weights_not_input_major(llm: LLM) -> list[str]:
    """Dense projection weights (Linear modules, dense routed-expert stacks) whose storage is not the
    input-major layout model/linear.py builds: a load or refit that rebinds a parameter would show here."""
    bad = []
    for role, model in llm.loaded.models.items():
        for name, module in model.named_modules():
            weights = []
            if isinstance(module, Linear):
                weights = [("weight", module.weight)]
            elif isinstance(module, RoutedExperts) and module.format == DENSE:
                weights = [(w, getattr(module, w)) for w in ("w1", "w3", "w2")]
            bad += [f"{role}:{name}.{w}" for w, t in weights if not t.transpose(-1, -2).is_contiguous()]
    return bad


def _drafter_logits(llm: LLM, role: str) -> torch.Tensor:
    target = llm.loaded.target
    drafter = llm.loaded.models[role]
    ids = [5, 9, 17, 33, 65, 129, 257, 7, 8, 9]
    batch = ForwardBatch.build([(0, ids, 0)])
    layers = getattr(drafter, "capture_layers", ())
    streams, captured = target(batch, target.allocate_cache(1, 32), capture_layers=layers)
    cache = drafter.allocate_cache(1, 32)
    if role == "mtp":
        _, logits = drafter(ForwardBatch.build([(0, ids[1:], 0)]), streams[:-1], cache)
        return logits
    drafter.commit(cache, batch, captured)
    return dspark_draft.draft(drafter, cache, [0], [ids[0]]).logits[0]  # the block's Markov-corrected logits


def test_refit_after_parameters_moved_writes_where_the_model_reads(checkpoints):
    """The weight plan keeps views of the resident storage (one per expert of a stacked parameter). Module.to()
    (here a dtype round trip) gives every float parameter new storage; the next refit must land there, not in
    the storage it replaced."""
    dense = {"load_format": "dummy", "dtype": "float32", "expert_dtype": DENSE}
    llm = LLM(checkpoints["mtp", "dummy"], seed=21, **dense)
    llm.update_weights(LLM(checkpoints["mtp", "dummy"], seed=22, **dense).iter_weights())
    for model in llm.loaded.models.values():
        model.to(torch.float64).to(torch.float32)
    moved = _pointers(llm)
    other = LLM(checkpoints["mtp", "dummy"], seed=23, **dense)
    llm.update_weights(other.iter_weights())
    assert _checksums(llm) == _checksums(other)
    assert _pointers(llm) == moved


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("role", ROLES)
def test_conformance(checkpoints, role, fmt):
    llm = _load(checkpoints, role, fmt)
    report = llm.weight_report()
    assert report["ready"]
    assert _dense_weights_not_input_major(llm) == []
    if fmt in STORED_IN:
        _assert_holds_checkpoint(llm, checkpoints[_family(role), STORED_IN[fmt]])
    roles_in_report = {t["model"] for t in report["tensors"].values()}
    assert roles_in_report == ({"target"} if role == "target" else {"target", role})

    # generates, drafter included
    out = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    if role != "target":
        logits = _drafter_logits(llm, role)
        assert logits.shape[-1] == llm.config.vocab_size and bool(torch.isfinite(logits).all())

    # every derived tensor equals its recomputation from the live weights
    derived_names = {n for n, t in report["tensors"].items() if t["derived"]}
    assert derived_names, "the first-layer mHC broadcast matrix must be registered as derived"
    for model in llm.loaded.models.values():
        for derived in model.derived_tensors():
            assert torch.equal(model.get_buffer(derived.name), derived.compute()), derived.name

    # an empty refit session changes nothing
    before_sums, before_ptrs = _checksums(llm), _pointers(llm)
    with llm.begin_weight_update():
        pass
    assert _checksums(llm) == before_sums and _pointers(llm) == before_ptrs

    # refit with this cell's weights == fresh load, bit for bit; addresses unchanged since build
    fresh = _fresh_equivalent(checkpoints, role, fmt)
    other = LLM(checkpoints[_family(role), "dummy"], load_format="dummy", draft=_draft(role), seed=99,
                dtype="float32", expert_dtype=EXPERTS[fmt])
    other_ptrs = _pointers(other)
    assert _checksums(other) != _checksums(fresh)
    other.update_weights(llm.iter_weights())
    assert _checksums(other) == _checksums(fresh)
    assert _pointers(other) == other_ptrs and _dense_weights_not_input_major(other) == []
    # same weights, same answers
    prompt = [[7, 8, 9, 10, 11, 12]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    assert (other.generate(prompt, greedy)[0].outputs[0].token_ids
            == fresh.generate(prompt, greedy)[0].outputs[0].token_ids)


@pytest.mark.parametrize("role", ("mtp", "dspark"))
def test_refit_session_covers_drafters(checkpoints, role):
    """Target and drafter tensors refit in one session; a dummy start ends equal to the real load."""
    real = LLM(checkpoints[_family(role), "native_fp4"], draft=role, dtype="float32")
    llm = LLM(checkpoints[_family(role), "dummy"], load_format="dummy", draft=role, seed=5, dtype="float32")
    version = llm.weight_report()["version"]
    tensors = list(real.iter_weights())
    drafter_names = [n for n, _ in tensors if n.startswith("mtp.")]
    assert drafter_names
    with llm.begin_weight_update(full=True) as session:
        half = len(tensors) // 2
        session.load(tensors[:half])
        session.load(tensors[half:])
    assert llm.weight_report()["version"] == version + 1
    assert _checksums(llm) == _checksums(real)
    assert torch.equal(_drafter_logits(llm, role), _drafter_logits(real, role))


def test_forward_refuses_unfinalized_models():
    from dsv4.config import ModelConfig
    from dsv4.embedded import EMBEDDED_MODELS

    cfg = ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])
    models = build_models(cfg, "fp4", torch.float32, "cpu", draft="mtp")
    target = models["target"]
    batch = ForwardBatch.build([(0, [1, 2, 3], 0)])
    with pytest.raises(WeightsNotReadyError, match="target model"):
        target(batch, target.allocate_cache(1, 8))
    target.process_weights_after_loading()
    streams, _ = target(batch, target.allocate_cache(1, 8))
    with pytest.raises(WeightsNotReadyError, match="mtp model"):
        models["mtp"](ForwardBatch.build([(0, [2, 3], 0)]), streams[:-1], models["mtp"].allocate_cache(1, 8))

    dspark_cfg = ModelConfig.from_dict(tiny_config(**DSPARK_FIELDS))
    models = build_models(dspark_cfg, "fp4", torch.float32, "cpu", draft="dspark")
    target, drafter = models["target"], models["dspark"]
    target.process_weights_after_loading()
    _, captured = target(batch, target.allocate_cache(1, 8), capture_layers=drafter.capture_layers)
    cache = drafter.allocate_cache(1, 8)
    with pytest.raises(WeightsNotReadyError, match="dspark model"):
        drafter.commit(cache, batch, captured)
    drafter.process_weights_after_loading()
    drafter.commit(cache, batch, captured)
    assert dspark_draft.draft(drafter, cache, [0], [4]).tokens.shape == (1, DSPARK_FIELDS["dspark_block_size"])


def test_finalize_is_idempotent_and_in_place():
    llm = LLM(DUMMY_MODEL, load_format="dummy", draft="mtp", dtype="float32")
    target = llm.loaded.target
    buffer = target.get_buffer("hc_attn_fn_broadcast")
    ptr, sums = buffer.data_ptr(), _checksums(llm)
    target.process_weights_after_loading()
    assert buffer.data_ptr() == ptr and _checksums(llm) == sums
    # a changed source is picked up by the next finalize, in the same storage
    with torch.no_grad():
        target.layers[0].hc_attn_fn.mul_(2)
    target.process_weights_after_loading()
    assert target.get_buffer("hc_attn_fn_broadcast").data_ptr() == ptr
    assert torch.equal(buffer, target.layers[0].hc_attn_fn.view(buffer.shape[0], llm.config.hc_mult, -1).sum(1))


def test_first_layer_broadcast_path_equals_repeated_path():
    """The 2-D first-layer path (pre-summed matrix, un-repeated embedding) equals running layer 0 on the
    explicitly repeated [T, hc, D] stream."""
    llm = LLM(DUMMY_MODEL, load_format="dummy", dtype="float32", seed=8)
    target = llm.loaded.target
    ids = list(range(2, 40))
    batch = ForwardBatch.build([(0, ids, 0)])
    embeds = target.embed(batch.token_ids)
    with torch.no_grad():
        broadcast = target.layers[0].forward_broadcast(
            embeds, target.get_buffer("hc_attn_fn_broadcast"), batch, target.allocate_cache(1, 64)[0]
        )
        repeated = target.layers[0](
            embeds.unsqueeze(1).expand(-1, llm.config.hc_mult, -1).contiguous(), batch, target.allocate_cache(1, 64)[0]
        )
    # fp32 sums in a different order: agree to rounding, relative to the streams' magnitude
    scale = float(repeated.abs().max())
    torch.testing.assert_close(broadcast, repeated, rtol=1e-5, atol=1e-5 * scale)


def test_dummy_load_is_seeded_and_valid():
    a = LLM(DUMMY_MODEL, load_format="dummy", seed=1)
    b = LLM(DUMMY_MODEL, load_format="dummy", seed=1)
    c = LLM(DUMMY_MODEL, load_format="dummy", seed=2)
    assert _checksums(a) == _checksums(b) != _checksums(c)
    for layer in a.loaded.target.layers:
        gate = layer.ffn.gate
        if gate.hashed:
            table = gate.tid2eid.long()
            assert int(table.min()) >= 0 and int(table.max()) < a.config.n_routed_experts
            assert all(len(set(row)) == len(row) for row in table.tolist())
        scale = layer.ffn.experts.w1_scale
        assert scale.dtype == torch.uint8 and int(scale.max()) < 255  # no NaN e8m0 byte
