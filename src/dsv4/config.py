"""Checkpoint `config.json` -> frozen, validated dataclasses.

One normaliser (`ModelConfig.from_dict`) folds every spelling we accept into one form: the
`DeepseekV4Config` form transformers 5.23 writes, and the legacy/native spellings DeepSeek's release
configs ship (`compress_ratios`, `compress_rate_csa/hca`, `num_hash_layers`, `qk_rope_head_dim`, a
top-level `expert_dtype`, `rope_scaling`). Every invalid value is a `ConfigError` naming the field.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dsv4.errors import ConfigError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)

HASH_MOE = "hash_moe"
MOE = "moe"
MLP_TYPES = (HASH_MOE, MOE)

SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")

# Routed-expert formats, defined here once: DENSE is float (bf16 / fp32); FP8 is e4m3 with block scales;
# FP4 is MXFP4-style e2m1 packed two per byte with ue8m0 scales. A checkpoint's
# `quantization_config.expert_dtype` names one of the quantized two; a load may choose any of the three.
DENSE, FP8, FP4 = "dense", "fp8", "fp4"
EXPERT_FORMATS = (DENSE, FP8, FP4)
QUANTIZED_EXPERT_FORMATS = (FP4, FP8)
SCALE_FMTS = ("ue8m0", "float")
QUANT_METHODS = ("fp8", "deepseek_v4_fp8")
CONFIG_FILE = "config.json"

# Native configs name a layer's attention by its compression ratio; these are the only values
# DeepSeek ships (the rates themselves may be overridden by compress_rate_csa / compress_rate_hca).
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3


@dataclass(frozen=True)
class RopeConfig:
    """One rotary table. `rotary_dim` trailing channels of each head rotate, in interleaved pairs."""

    theta: float
    rotary_dim: int
    yarn_factor: float | None = None  # None: plain RoPE
    yarn_original_max_position: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of a native FP8/FP4 checkpoint."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"  # dense FP8 scales: "ue8m0" (powers of two) or "float" (fp32)
    expert_dtype: str = FP4  # routed experts: FP4 (MXFP4 e2m1) or FP8 (e4m3 block)
    fp4_group_size: int = 32  # inputs sharing one ue8m0 scale in an FP4 expert row


# The two DSpark releases. V4-Flash-DSpark: the drafter reads the OUTPUT streams of its target layers
# and collapses its last stage with `hc_head_*`. V4.1-Flash: it reads their INPUT streams, its stages
# carry the mHC `pre` mix one sublayer forward, the head collapses with the last carried mix (no
# hc_head), and it routes over its own expert bank. Only V4.1 configs carry that bank's fields
# (`dspark_n_routed_experts` / `dspark_num_experts_per_tok`), so they are what tells the two apart.
DSPARK_V4 = "v4-flash-dspark"
DSPARK_V41 = "v4.1"
# `mtp.{s}.` tensor names: a checkpoint's DSpark stage s (HF layouts may prefix `model.`).
_STAGE_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.")


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter's config fields, as DeepSeek's releases spell them (`dspark_*`, `n_mtp_layers`).

    `num_stages` comes from `n_mtp_layers` when config.json states it (`stages_declared`); otherwise it
    is provisional (`num_nextn_predict_layers`, which V4-Flash-DSpark's HF config leaves at 1 for its 3
    stages) until `ModelConfig.with_checkpoint_names` counts the checkpoint's `mtp.{s}` stages.
    """

    block_size: int  # draft positions per block: [anchor, noise x (block_size - 1)]
    noise_token_id: int  # the token embedded at the block's non-anchor positions
    target_layer_ids: tuple[int, ...]  # strictly increasing target layers whose streams feed main_proj
    markov_rank: int  # r of markov_w1 / markov_w2 [vocab, r]
    num_stages: int  # drafter blocks, native `mtp.0` .. `mtp.{num_stages - 1}`
    stages_declared: bool = True
    n_routed_experts: int | None = None  # V4.1: the stages' own expert bank (None: the target's)
    num_experts_per_tok: int | None = None

    @property
    def variant(self) -> str:
        """DSPARK_V41 when the config carries V4.1's drafter expert-bank fields, else DSPARK_V4."""
        own_bank = self.n_routed_experts is not None or self.num_experts_per_tok is not None
        return DSPARK_V41 if own_bank else DSPARK_V4


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V4 model's shape. Field names follow transformers' `DeepseekV4Config`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    rope_main: RopeConfig
    rope_compress: RopeConfig
    max_position_embeddings: int
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    quant: QuantConfig | None = None
    dspark: DSparkConfig | None = None
    torch_dtype: str | None = None  # the dtype the checkpoint's floating tensors were saved in
    source: str = field(default="<dict>", compare=False)

    # ---- derived sizes ----
    @property
    def rope_dim(self) -> int:
        return self.rope_main.rotary_dim

    @property
    def hc_mix(self) -> int:
        """Width of the mHC projection: hc pre + hc post + hc*hc comb coefficients."""
        return (2 + self.hc_mult) * self.hc_mult

    def compress_rate(self, layer_type: str) -> int:
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[layer_type]

    # ---- parsing ----
    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"{path}: no such file or directory")
        if path.is_dir():
            if not (path / CONFIG_FILE).is_file():
                raise ConfigError(f"{path}: no {CONFIG_FILE} in this directory, so it is not a checkpoint")
            path = path / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read ({exc})") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> ModelConfig:
        return _ConfigParser(raw, source).parse()

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `DeepseekV4Config` form of this config (what `dsv4 convert --layout hf` writes)."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "num_key_value_heads": 1,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "partial_rotary_factor": self.rope_dim / self.head_dim,
            "rope_theta": self.rope_main.theta,
            "compress_rope_theta": self.rope_compress.theta,
            "compress_rates": {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca},
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        for f in fields(self):
            if f.name in _PLAIN_FIELDS:
                out[f.name] = getattr(self, f.name)
        if self.rope_compress.yarn_factor is not None:
            out["rope_parameters"] = {
                "rope_type": "yarn",
                "factor": self.rope_compress.yarn_factor,
                "original_max_position_embeddings": self.rope_compress.yarn_original_max_position,
                "beta_fast": self.rope_compress.yarn_beta_fast,
                "beta_slow": self.rope_compress.yarn_beta_slow,
            }
        if self.quant is not None:
            out["quantization_config"] = _quant_to_dict(self.quant)
        if self.dspark is not None:
            out.update(_dspark_to_dict(self.dspark))
        if self.torch_dtype is not None:
            out["torch_dtype"] = self.torch_dtype
        return out

    def to_native_dict(self) -> dict[str, Any]:
        """DeepSeek's release spelling (what `dsv4 convert --layout native` writes)."""
        out = self.to_hf_dict()
        ratio_of = {SLIDING: 0, CSA: 4, HCA: 128}
        out["compress_ratios"] = [ratio_of[t] for t in self.layer_types]
        out["compress_rate_csa"] = self.compress_rate_csa
        out["compress_rate_hca"] = self.compress_rate_hca
        out["qk_rope_head_dim"] = self.rope_dim
        for key in ("layer_types", "compress_rates", "partial_rotary_factor"):
            out.pop(key)
        hash_layers = sum(t == HASH_MOE for t in self.mlp_layer_types)
        if self.mlp_layer_types == (HASH_MOE,) * hash_layers + (MOE,) * (self.num_hidden_layers - hash_layers):
            out.pop("mlp_layer_types")
            out["num_hash_layers"] = hash_layers
        return out

    def with_quant(self, quant: QuantConfig | None) -> ModelConfig:
        return _replace(self, quant=quant)

    def with_checkpoint_names(self, names: Iterable[str]) -> ModelConfig:
        """Resolve what only the tensor names can tell: the DSpark stage count, from the checkpoint's
        `mtp.{s}` names, when config.json did not state `n_mtp_layers`.

        Raises:
            ConfigError: config.json states `n_mtp_layers` and the checkpoint holds another stage count.
        """
        if self.dspark is None:
            return self
        stages = {int(m[1]) for name in names if (m := _STAGE_NAME.match(name))}
        if not stages:
            return self
        found = max(stages) + 1
        if self.dspark.stages_declared:
            if found != self.dspark.num_stages:
                raise ConfigError(
                    f"{self.source}: field 'n_mtp_layers': {self.dspark.num_stages} DSpark stages, but the "
                    f"checkpoint holds mtp.0 .. mtp.{found - 1} ({found} stages)"
                )
            return self
        return _replace(self, dspark=replace(self.dspark, num_stages=found, stages_declared=True))


# Fields copied verbatim between the dict and the dataclass.
_PLAIN_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "routed_scaling_factor", "scoring_func", "swiglu_limit", "sliding_window", "index_n_heads",
    "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps",
    "max_position_embeddings", "num_nextn_predict_layers",
)
_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
    "max_position_embeddings",
)
# transformers' class defaults (V4-Flash-sized) for fields a config may omit.
_DEFAULTS: dict[str, Any] = {
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
}


# DSpark keys: any of them makes a config a DSpark one; these must then all be present.
_DSPARK_REQUIRED = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
# V4.1's experts-per-token of the drafter's bank: the HF config's spelling, then the inference config's.
_DSPARK_PER_TOKEN_KEYS = ("dspark_num_experts_per_tok", "dspark_n_activated_experts")
_DSPARK_KEYS = (*_DSPARK_REQUIRED, "dspark_n_routed_experts", *_DSPARK_PER_TOKEN_KEYS)


def _replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def _quant_to_dict(q: QuantConfig) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(q.weight_block_size),
        "scale_fmt": q.scale_fmt,
        "expert_dtype": q.expert_dtype,
    }


def _dspark_to_dict(d: DSparkConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "dspark_block_size": d.block_size,
        "dspark_noise_token_id": d.noise_token_id,
        "dspark_target_layer_ids": list(d.target_layer_ids),
        "dspark_markov_rank": d.markov_rank,
        "n_mtp_layers": d.num_stages,
    }
    if d.n_routed_experts is not None:
        out["dspark_n_routed_experts"] = d.n_routed_experts
    if d.num_experts_per_tok is not None:
        out["dspark_num_experts_per_tok"] = d.num_experts_per_tok
    return out


class _ConfigParser:
    """Reads one raw dict; every error names `source` and the field."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw = raw
        self.source = source

    def fail(self, fld: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{fld}': {msg}")

    def get(self, key: str, required: bool = True) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if key in _DEFAULTS:
            return _DEFAULTS[key]
        if required:
            raise self.fail(key, "missing")
        return None

    def get_int(self, key: str, minimum: int = 1) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {value!r}")
        return value

    def get_float(self, key: str, positive: bool = False) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, f"expected a finite number, got {value!r}")
        if positive and value <= 0:
            raise self.fail(key, f"expected a positive number, got {value!r}")
        return float(value)

    def parse(self) -> ModelConfig:
        model_type = self.raw.get("model_type")
        if model_type not in (None, "deepseek_v4"):
            raise self.fail("model_type", f"unsupported model type {model_type!r} (dsv4 runs 'deepseek_v4')")
        ints = {k: self.get_int(k) for k in _INT_FIELDS}
        n_layers = ints["num_hidden_layers"]
        hd = ints["head_dim"]

        nkv = self.raw.get("num_key_value_heads", 1)
        if nkv not in (None, 1):
            raise self.fail("num_key_value_heads", f"DeepSeek-V4 has one shared K=V head, got {nkv}")
        nshared = self.raw.get("n_shared_experts", 1)
        if nshared not in (None, 1):
            raise self.fail("n_shared_experts", f"DeepSeek-V4 has exactly one shared expert, got {nshared}")
        if self.raw.get("tie_word_embeddings"):
            raise self.fail("tie_word_embeddings", "DeepSeek-V4 does not tie embedding and head")

        scoring = self.get("scoring_func")
        if scoring not in SCORING_FUNCS:
            raise self.fail("scoring_func", f"expected one of {SCORING_FUNCS}, got {scoring!r}")

        csa_rate, hca_rate = self._compress_rates()
        layer_types = self._layer_types(n_layers)
        mlp_types = self._mlp_layer_types(n_layers)
        rope_dim = self._rope_dim(hd)
        if rope_dim > ints["index_head_dim"]:
            raise self.fail("qk_rope_head_dim", f"rotary dim {rope_dim} exceeds index_head_dim")
        if ints["num_attention_heads"] % ints["o_groups"]:
            raise self.fail("o_groups", f"num_attention_heads ({ints['num_attention_heads']}) is not divisible")
        if ints["num_experts_per_tok"] > ints["n_routed_experts"]:
            raise self.fail("num_experts_per_tok", "exceeds n_routed_experts")
        main, compress = self._rope(rope_dim, ints["max_position_embeddings"])

        return ModelConfig(
            **ints,
            routed_scaling_factor=self.get_float("routed_scaling_factor", positive=True),
            scoring_func=scoring,
            swiglu_limit=self.get_float("swiglu_limit", positive=True),
            hc_eps=self.get_float("hc_eps", positive=True),
            rms_norm_eps=self.get_float("rms_norm_eps", positive=True),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            compress_rate_csa=csa_rate,
            compress_rate_hca=hca_rate,
            rope_main=main,
            rope_compress=compress,
            num_nextn_predict_layers=self.get_int("num_nextn_predict_layers", minimum=0),
            bos_token_id=self.raw.get("bos_token_id", 0),
            eos_token_ids=self._eos(),
            quant=self._quant(),
            dspark=self._dspark(n_layers, ints["vocab_size"], ints["n_routed_experts"]),
            torch_dtype=self.raw.get("torch_dtype") or self.raw.get("dtype"),
            source=self.source,
        )

    def _compress_rates(self) -> tuple[int, int]:
        rates = dict(_DEFAULT_COMPRESS_RATES)
        given = self.raw.get("compress_rates")
        if given is not None:
            if not isinstance(given, dict) or set(given) - {CSA, HCA}:
                raise self.fail("compress_rates", f"expected keys {CSA!r}/{HCA!r}, got {given!r}")
            rates.update(given)
        for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if self.raw.get(key) is not None:
                rates[layer_type] = self.raw[key]
        for layer_type, rate in rates.items():
            if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
                raise self.fail("compress_rates", f"{layer_type} rate must be a positive integer, got {rate!r}")
        return rates[CSA], rates[HCA]

    def _layer_types(self, n: int) -> tuple[str, ...]:
        explicit, ratios = self.raw.get("layer_types"), self.raw.get("compress_ratios")
        if explicit is not None:
            types, fld = list(explicit), "layer_types"
        elif ratios is not None:
            fld = "compress_ratios"
            unknown = [r for r in ratios if r not in _RATIO_TO_LAYER_TYPE]
            if unknown:
                raise self.fail(fld, f"values must be in {sorted(_RATIO_TO_LAYER_TYPE)}, got {unknown}")
            types = [_RATIO_TO_LAYER_TYPE[r] for r in ratios]
        else:
            # transformers' class default: two HCA layers, then HCA/CSA alternating.
            fld = "layer_types"
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        types = types[:n]  # release configs list the MTP layers' ratios too
        if len(types) != n:
            raise self.fail(fld, f"has {len(types)} entries for {n} layers")
        bad = [t for t in types if t not in ATTENTION_TYPES]
        if bad:
            raise self.fail(fld, f"entries must be in {ATTENTION_TYPES}, got {bad}")
        return tuple(types)

    def _mlp_layer_types(self, n: int) -> tuple[str, ...]:
        explicit = self.raw.get("mlp_layer_types")
        if explicit is not None:
            types = list(explicit)[:n]
        else:
            n_hash = self.raw.get("num_hash_layers", _DEFAULT_NUM_HASH_LAYERS)
            if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
                raise self.fail("num_hash_layers", f"expected a non-negative integer, got {n_hash!r}")
            types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        if len(types) != n:
            raise self.fail("mlp_layer_types", f"has {len(types)} entries for {n} layers")
        bad = [t for t in types if t not in MLP_TYPES]
        if bad:
            raise self.fail("mlp_layer_types", f"entries must be in {MLP_TYPES}, got {bad}")
        return tuple(types)

    def _rope_dim(self, head_dim: int) -> int:
        factor = self.raw.get("partial_rotary_factor")
        if factor is None and isinstance(self.raw.get("rope_parameters"), dict):
            factor = self.raw["rope_parameters"].get("main", {}).get("partial_rotary_factor")
        legacy = self.raw.get("qk_rope_head_dim")
        if factor is not None:
            dim, fld = head_dim * float(factor), "partial_rotary_factor"
        elif legacy is not None:
            dim, fld = legacy, "qk_rope_head_dim"
        else:
            dim, fld = head_dim * 64 / 512, "partial_rotary_factor"  # transformers' default ratio
        if dim != int(dim) or int(dim) % 2 or not 0 < dim <= head_dim:
            raise self.fail(fld, f"rotary dim {dim} must be an even integer in (0, head_dim={head_dim}]")
        return int(dim)

    def _rope(self, rope_dim: int, max_pos: int) -> tuple[RopeConfig, RopeConfig]:
        params = self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise self.fail("rope_parameters", f"expected an object, got {params!r}")
        main_theta = self.get_float("rope_theta", positive=True)
        compress_theta = self.get_float("compress_rope_theta", positive=True)
        if isinstance(params.get("main"), dict):
            main_theta = float(params["main"].get("rope_theta", main_theta))
            if params["main"].get("rope_type", "default") != "default":
                raise self.fail("rope_parameters.main.rope_type", "YaRN never applies to the main table")
            params = params.get("compress") or {}
            compress_theta = float(params.get("rope_theta", compress_theta))
        main = RopeConfig(theta=main_theta, rotary_dim=rope_dim)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return main, RopeConfig(theta=compress_theta, rotary_dim=rope_dim)
        if rope_type != "yarn":
            raise self.fail("rope_parameters.rope_type", f"expected 'default' or 'yarn', got {rope_type!r}")
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        if not isinstance(factor, (int, float)) or factor < 1:
            raise self.fail("rope_parameters.factor", f"YaRN factor must be >= 1, got {factor!r}")
        if not isinstance(original, int) or original < 1:
            raise self.fail("rope_parameters.original_max_position_embeddings", f"got {original!r}")
        attention_factor = params.get("attention_factor", 1.0)
        if attention_factor not in (None, 1.0):
            raise self.fail("rope_parameters.attention_factor", "DeepSeek-V4 does not scale cos/sin (must be 1.0)")
        compress = RopeConfig(
            theta=compress_theta,
            rotary_dim=rope_dim,
            yarn_factor=float(factor),
            yarn_original_max_position=original,
            yarn_beta_fast=float(params.get("beta_fast") or 32),
            yarn_beta_slow=float(params.get("beta_slow") or 1),
        )
        return main, compress

    def _eos(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id", 1)
        if eos is None:
            return ()
        ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise self.fail("eos_token_id", f"expected token ids, got {eos!r}")
        return ids

    def _quant(self) -> QuantConfig | None:
        q = self.raw.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict):
            raise self.fail("quantization_config", f"expected an object, got {q!r}")
        method = q.get("quant_method")
        if method not in QUANT_METHODS:
            raise self.fail("quantization_config.quant_method", f"expected one of {QUANT_METHODS}, got {method!r}")
        block = q.get("weight_block_size", [128, 128])
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)):
            raise self.fail("quantization_config.weight_block_size", f"expected [rows, cols], got {block!r}")
        scale_fmt = q.get("scale_fmt") or "float"
        if scale_fmt not in SCALE_FMTS:
            raise self.fail("quantization_config.scale_fmt", f"expected one of {SCALE_FMTS}, got {scale_fmt!r}")
        # Resolved once the whole config is known: the in-dict value wins, then the top-level one.
        expert_dtype = q.get("expert_dtype") or self.raw.get("expert_dtype") or FP4
        if expert_dtype not in QUANTIZED_EXPERT_FORMATS:
            raise self.fail("quantization_config.expert_dtype",
                            f"expected one of {QUANTIZED_EXPERT_FORMATS}, got {expert_dtype!r}")
        return QuantConfig(weight_block_size=tuple(block), scale_fmt=scale_fmt, expert_dtype=expert_dtype)

    def _dspark(self, n_layers: int, vocab: int, n_experts: int) -> DSparkConfig | None:
        if not any(key in self.raw for key in _DSPARK_KEYS):
            return None
        missing = [key for key in _DSPARK_REQUIRED if key not in self.raw]
        if missing:
            raise self.fail(missing[0], f"missing (a DSpark config needs {', '.join(_DSPARK_REQUIRED)})")
        ids = self.raw["dspark_target_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in ids
        ):
            raise self.fail("dspark_target_layer_ids", f"expected layer indices in [0, {n_layers}), got {ids!r}")
        if any(b <= a for a, b in itertools.pairwise(ids)):
            raise self.fail(
                "dspark_target_layer_ids",
                f"must be strictly increasing (main_proj reads the layers' features concatenated in ascending "
                f"order), got {ids!r}",
            )
        noise = self.get_int("dspark_noise_token_id", minimum=0)
        if noise >= vocab:
            raise self.fail("dspark_noise_token_id", f"{noise} is not a token id (vocab_size {vocab})")
        declared = self.raw.get("n_mtp_layers") is not None
        stages = self.get_int("n_mtp_layers") if declared else self.get_int("num_nextn_predict_layers")
        bank = self.raw.get("dspark_n_routed_experts")
        per_tok_key = next((k for k in _DSPARK_PER_TOKEN_KEYS if k in self.raw), None)
        bank = None if bank is None else self.get_int("dspark_n_routed_experts")
        per_tok = None if per_tok_key is None else self.get_int(per_tok_key)
        if per_tok is not None and per_tok > (bank if bank is not None else n_experts):
            raise self.fail(per_tok_key, f"{per_tok} experts per token exceeds the drafter's expert bank")
        return DSparkConfig(
            block_size=self.get_int("dspark_block_size"),
            noise_token_id=noise,
            target_layer_ids=tuple(ids),
            markov_rank=self.get_int("dspark_markov_rank"),
            num_stages=stages,
            stages_declared=declared,
            n_routed_experts=bank,
            num_experts_per_tok=per_tok,
        )
