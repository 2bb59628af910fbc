"""A DSpark checkpoint as DeepSeek ships it loads with draft="dspark", completely: nothing unexpected,
nothing missing, every value where it belongs.

The checkpoints are written by hand here (safetensors.torch.save_file on a dict built in the test, never
through dsv4's exporter), with the release's names, shapes and dtypes: the target in the native FP8 / FP4
layout, and the drafter's `mtp.{s}.*` stages, `mtp.0.main_proj` (block FP8 with its `.scale`) and
`main_norm`, the last stage's `norm`, `hc_head_*`, `markov_head.markov_w1` / `markov_w2` [V, r] and
`confidence_head.proj` [1, D + r]; for V4.1, `markov_head.embed` / `markov_head.head`, no hc_head, the
drafter's own expert bank and the embed / head copies its release carries. Also: the config fields, the
stage count read from the names, and the errors a broken checkpoint or config gets.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dspark_reference as dref
import reference as ref
from dsv4 import LLM
from dsv4.cli import main as cli_main
from dsv4.config import DSPARK_V4, DSPARK_V41, ModelConfig
from dsv4.errors import CheckpointError, ConfigError

TARGET_SEED, DSPARK_SEED = 41, 42
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
V4 = {"dspark_block_size": 5, "dspark_noise_token_id": 7, "dspark_target_layer_ids": [1, 2, 3],
      "dspark_markov_rank": 8, "n_mtp_layers": 3}
V41 = {**V4, "dspark_target_layer_ids": [0, 2], "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2}
LAST = "mtp.2."


@pytest.fixture(scope="module")
def target_stored():
    """The target's tensors as a native FP8 / FP4 release stores them."""
    native = ref.native_state_dict(ref.build_reference_model(ref.tiny_config(), TARGET_SEED))
    return ref.quantize_native_tensors(native, dense="fp8", expert_dtype="fp4")


def _write(root, target_stored, fields: dict, drafter: dict[str, torch.Tensor], config_changes=None):
    """A checkpoint directory: native config.json with the DSpark fields, one safetensors file."""
    config = ref.native_config(ref.tiny_config(), QUANTIZATION)
    config.update(fields)
    for key, value in (config_changes or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    tensors = {name: t.contiguous() for name, t in {**target_stored, **drafter}.items()}
    save_file(tensors, str(root / "model.safetensors"))
    return root


def _released(fields: dict) -> dict[str, torch.Tensor]:
    config = ref.tiny_config(**fields)
    stored = dref.released_storage(dref.released_dspark_tensors(config, DSPARK_SEED), expert_dtype="fp4")
    if "dspark_n_routed_experts" in fields:  # V4.1 ships copies of the embedding and head with the drafter
        vocab, hidden = config["vocab_size"], config["hidden_size"]
        stored["mtp.0.embed.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
        stored[f"{LAST}head.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    return stored


@pytest.mark.parametrize("fields", [V4, V41], ids=["v4-flash-dspark", "v4.1"])
def test_released_checkpoint_loads_completely(tmp_path, target_stored, fields):
    stored = _released(fields)
    path = _write(tmp_path / "ckpt", target_stored, fields, stored)
    llm = LLM(path, draft="dspark", dtype="float32")
    drafter = llm.loaded.models["dspark"]
    v41 = fields is V41
    assert drafter.spec.variant == (DSPARK_V41 if v41 else DSPARK_V4)

    # nothing unexpected: only the release's copies of the target's embedding and head are set aside
    aliases = {"mtp.0.embed.weight", f"{LAST}head.weight"} if v41 else set()
    assert llm.loaded.ignored == aliases
    # nothing missing: the drafter's tensors are exactly the released weights (V4.1's Markov names folded)
    spelled = {f"{LAST}markov_head.embed.weight": f"{LAST}markov_head.markov_w1.weight",
               f"{LAST}markov_head.head.weight": f"{LAST}markov_head.markov_w2.weight"}
    released = {spelled.get(n, n) for n in stored if not n.endswith(".scale")} - aliases
    assert llm.loaded.slot_table().names("dspark") == released

    # the release's shapes, and the values where they belong
    values = dref.stored_values(stored)
    vocab, hidden, rank = 512, 64, fields["dspark_markov_rank"]
    last = drafter.mtp[-1]
    w1, w2 = ("embed", "head") if v41 else ("markov_w1", "markov_w2")
    assert last.markov_head.markov_w1.weight.shape == last.markov_head.markov_w2.weight.shape == (vocab, rank)
    assert last.confidence_head.proj.weight.shape == (1, hidden + rank)
    assert torch.equal(last.markov_head.markov_w1.weight, values[f"{LAST}markov_head.{w1}.weight"])
    assert torch.equal(last.markov_head.markov_w2.weight, values[f"{LAST}markov_head.{w2}.weight"])
    assert torch.equal(last.confidence_head.proj.weight, values[f"{LAST}confidence_head.proj.weight"])
    assert torch.equal(drafter.mtp[0].main_proj.weight, values["mtp.0.main_proj.weight"])  # FP8 x scale
    assert stored["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(drafter.mtp[1].attn.wkv.weight, values["mtp.1.attn.wkv.weight"])
    experts = drafter.mtp[1].ffn.experts  # FP4 resident: the file's bytes
    assert torch.equal(experts.w1[3], stored["mtp.1.ffn.experts.3.w1.weight"])
    assert experts.num_experts == fields.get("dspark_n_routed_experts", 8)
    assert drafter.mtp[1].ffn.gate.top_k == fields.get("dspark_num_experts_per_tok", 2)
    assert hasattr(last, "hc_head_fn") != v41

    # dsv4 inspect agrees, without reading tensor data
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        assert cli_main(["inspect", str(path), "--draft", "dspark", "--json"]) == 0
    assert json.loads(report.getvalue())["loadable"]


def test_stage_count_comes_from_the_names(tmp_path, target_stored):
    """V4-Flash-DSpark's HF config says num_nextn_predict_layers 1 and no n_mtp_layers; its mtp.0 .. mtp.2
    names say 3 stages."""
    path = _write(tmp_path / "ckpt", target_stored, V4, _released(V4),
                  config_changes={"n_mtp_layers": None, "num_nextn_predict_layers": 1})
    assert ModelConfig.from_file(path).dspark.num_stages == 1  # provisional, from the config alone
    llm = LLM(path, draft="dspark", dtype="float32")
    assert len(llm.loaded.models["dspark"].mtp) == 3


def test_declared_stage_count_must_match_the_names(tmp_path, target_stored):
    path = _write(tmp_path / "ckpt", target_stored, V4, _released(V4), config_changes={"n_mtp_layers": 2})
    with pytest.raises(ConfigError, match=r"'n_mtp_layers': 2 DSpark stages, but the checkpoint holds mtp.0 .. mtp.2"):
        LLM(path, draft="dspark", dtype="float32")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop_confidence", r"missing tensor\(s\): mtp.2.confidence_head.proj.weight"),
        ("transposed_w2", r"mtp.2.markov_head.markov_w2.weight.*\(8, 512\) does not match the model's \(512, 8\)"),
        ("stray_head_stack", r"unexpected tensor 'mtp.1.markov_head.markov_w1.weight'"),
        ("main_proj_without_scale", r"mtp.0.main_proj.weight.*has no scale"),
    ],
)
def test_broken_checkpoint_gets_one_clear_error(tmp_path, target_stored, change, message):
    stored = _released(V4)
    if change == "drop_confidence":
        del stored[f"{LAST}confidence_head.proj.weight"]
    elif change == "transposed_w2":  # dsv4's old layout: W2 [r, V]
        stored[f"{LAST}markov_head.markov_w2.weight"] = stored[f"{LAST}markov_head.markov_w2.weight"].t()
    elif change == "stray_head_stack":
        stored["mtp.1.markov_head.markov_w1.weight"] = stored[f"{LAST}markov_head.markov_w1.weight"].clone()
    else:
        del stored["mtp.0.main_proj.scale"]
    path = _write(tmp_path / "ckpt", target_stored, V4, stored)
    with pytest.raises(CheckpointError, match=message):
        LLM(path, draft="dspark", dtype="float32")


def _config(**fields) -> dict:
    """The tiny HF config with the DSpark fields; a None field is left out."""
    return {k: v for k, v in ref.tiny_config(**{**V4, **fields}).items() if v is not None}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dspark_target_layer_ids": [3, 1]}, r"'dspark_target_layer_ids': must be strictly increasing .* \[3, 1\]"),
        ({"dspark_target_layer_ids": [1, 1]}, r"'dspark_target_layer_ids': must be strictly increasing"),
        ({"dspark_target_layer_ids": [1, 4]}, r"'dspark_target_layer_ids': expected layer indices in \[0, 4\)"),
        ({"dspark_noise_token_id": 512}, r"'dspark_noise_token_id': 512 is not a token id \(vocab_size 512\)"),
        ({"dspark_noise_token_id": None}, r"'dspark_noise_token_id': missing"),
        ({"dspark_markov_rank": 0}, r"'dspark_markov_rank': expected an integer >= 1, got 0"),
        ({"dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 5},
         r"'dspark_num_experts_per_tok': 5 experts per token exceeds the drafter's expert bank"),
    ],
)
def test_bad_dspark_config_names_the_field(fields, message):
    raw = _config(**fields)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw, source="dspark/config.json")


def test_config_fields_as_released():
    cfg = ModelConfig.from_dict(_config())
    spec = cfg.dspark
    assert (spec.block_size, spec.noise_token_id, spec.target_layer_ids, spec.markov_rank, spec.num_stages) == (
        5, 7, (1, 2, 3), 8, 3)
    assert spec.variant == DSPARK_V4 and spec.n_routed_experts is None
    # V4.1's inference config spells the drafter's experts per token dspark_n_activated_experts
    v41 = ModelConfig.from_dict(_config(dspark_n_routed_experts=4, dspark_n_activated_experts=3)).dspark
    assert (v41.variant, v41.n_routed_experts, v41.num_experts_per_tok) == (DSPARK_V41, 4, 3)
    # the written config reads back the same
    assert ModelConfig.from_dict(cfg.to_native_dict()).dspark == spec
    assert ModelConfig.from_dict(_config(n_mtp_layers=None)).dspark.num_stages == 1  # num_nextn_predict_layers


@pytest.mark.parametrize("fields", [V4, V41], ids=["v4-flash-dspark", "v4.1"])
def test_refit_and_export_round_trip(tmp_path, target_stored, fields):
    """A dummy-started engine refit with the loaded weights (target and drafter in one session), and dsv4's own
    native export of them, both end bit-identical to the load; the export stores main_proj as block FP8."""
    path = _write(tmp_path / "ckpt", target_stored, fields, _released(fields))
    llm = LLM(path, draft="dspark", dtype="float32")
    sums = {n: t["checksum"] for n, t in llm.weight_report()["tensors"].items()}
    dummy = LLM(path, load_format="dummy", draft="dspark", dtype="float32", seed=3)
    assert {n: t["checksum"] for n, t in dummy.weight_report()["tensors"].items()} != sums
    dummy.update_weights(llm.iter_weights())
    assert {n: t["checksum"] for n, t in dummy.weight_report()["tensors"].items()} == sums
    out = llm.save_checkpoint(tmp_path / "export", layout="native", dense="fp8")
    exported = LLM(out, draft="dspark", dtype="float32")
    assert {n: t["checksum"] for n, t in exported.weight_report()["tensors"].items()} == sums
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("mtp.0.main_proj.weight").dtype == torch.float8_e4m3fn and "mtp.0.main_proj.scale" in names
    assert (f"{LAST}hc_head_fn" in names) != (fields is V41)
