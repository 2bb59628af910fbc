"""An independent fp32 re-implementation of DeepSeek's released DSpark forward, for tests.

Written from the release's description (DeepSeek-V4-Flash-DSpark `inference/model.py`: DSparkAttention,
DSparkBlock.forward_embed / forward_head, the Markov and confidence heads; V4.1-Flash's variant; the DSpark
paper), in plain torch over a dict of tensors under their released names. It shares no code with dsv4 and
deliberately computes things the plain way dsv4 does not: the first stage runs on the explicitly repeated
[T, hc, D] stream (no pre-summed broadcast matrix), RoPE is a complex multiplication, the context ring has
exactly `window` rows written at position % window as the release's kv_cache does, mHC runs per formula.

    features   f_t    = concat over dspark_target_layer_ids of mean_hc(stream read at that target layer)
    main_x_t          = main_norm(main_proj(f_t))
    ring (per stage)  = kv_norm(wkv(main_x_t)) rotated at t, for the last `window` committed positions
    block             = [anchor, noise x (B-1)] at positions p+1 .. p+B, repeated over hc
    stage             = mHC(attention over [ring rows ; block rows], no mask inside the block) then mHC(MoE)
    V4 head           = hc_head(streams) (last stage's hc_head_*);  V4.1: collapse with the carried pre mix
    base logits       = head(norm(head hidden))
    Markov, greedy    = logits_i = base_i + W2 @ W1[prev_i], prev_0 = anchor, prev_{i+1} = argmax logits_i
    confidence        = sigmoid(proj([head hidden_i ; W1[prev_i]]))

Also `block_causal`, the same stage math run causally on a plain sequence, which tests check against
transformers' DeepseekV4DecoderLayer so that this oracle's block arithmetic is itself verified.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

import reference as ref

V41_FIELDS = ("dspark_n_routed_experts", "dspark_num_experts_per_tok")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def rotate(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rope_dim: int, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing rope_dim channels of x [T, ..., hd] at positions [T], pairs (2i, 2i+1) read as the
    complex number x_2i + i x_2i+1 and multiplied by exp(+-i t theta^(-2i/rope_dim)) (DeepSeek's form)."""
    freqs = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = positions.double()[:, None] * freqs[None, :]  # [T, rope_dim/2]
    turn = torch.polar(torch.ones_like(angles), -angles if inverse else angles).to(torch.complex64)
    turn = turn.view(turn.shape[0], *([1] * (x.dim() - 2)), -1)
    pairs = torch.view_as_complex(x[..., -rope_dim:].float().contiguous().view(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * turn).flatten(-2)
    return torch.cat((x[..., :-rope_dim].float(), rotated), dim=-1)


def sinkhorn_mix(flat: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                 iters: int, norm_eps: float, hc_eps: float):
    """mHC coefficients from flattened streams [T, hc*D]: pre [T, hc], post [T, hc], comb [T, hc, hc]
    (comb[i, j]: from stream i to stream j)."""
    mixes = rms_norm(flat, None, norm_eps) @ fn.float().t()
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = torch.softmax(mixes[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=1, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=2, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=1, keepdim=True) + hc_eps)
    return pre, post, comb


class DSparkReference:
    """The released DSpark drafter over `tensors` (native names: embed.weight, head.weight, mtp.{s}.*)."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor]):
        self.c = config
        self.t = {name: t.float() for name, t in tensors.items() if t.is_floating_point()}
        self.v41 = any(key in config for key in V41_FIELDS)
        self.stages = config["n_mtp_layers"]
        self.block_size = config["dspark_block_size"]
        self.window = config["sliding_window"]
        self.hc = config["hc_mult"]
        self.eps = config["rms_norm_eps"]
        self.hc_eps = config["hc_eps"]
        self.head_dim = config["head_dim"]
        self.rope_dim = int(self.head_dim * config["partial_rotary_factor"])
        self.theta = config["rope_theta"]  # stages are sliding layers: the main table, no YaRN
        self.top_k = config.get("dspark_num_experts_per_tok", config["num_experts_per_tok"])
        self.n_experts = config.get("dspark_n_routed_experts", config["n_routed_experts"])
        last = f"mtp.{self.stages - 1}."
        names = ("embed", "head") if self.v41 else ("markov_w1", "markov_w2")
        self.w1 = self.t[f"{last}markov_head.{names[0]}.weight"]  # [V, r]
        self.w2 = self.t[f"{last}markov_head.{names[1]}.weight"]  # [V, r]

    def w(self, stage: int, name: str) -> torch.Tensor:
        return self.t[f"mtp.{stage}.{name}"]

    # ---- context ----
    def main_x(self, features: torch.Tensor) -> torch.Tensor:
        return rms_norm(features.float() @ self.w(0, "main_proj.weight").t(), self.w(0, "main_norm.weight"), self.eps)

    def context_keys(self, stage: int, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kv = rms_norm(main_x @ self.w(stage, "attn.wkv.weight").t(), self.w(stage, "attn.kv_norm.weight"), self.eps)
        return rotate(kv, positions, self.theta, self.rope_dim)

    def new_ring(self) -> dict:
        """The release's per-stage kv_cache: `window` rows, position t at row t % window."""
        return {"keys": [torch.zeros(self.window, self.head_dim) for _ in range(self.stages)], "count": 0}

    def commit(self, ring: dict, features: torch.Tensor, first_position: int) -> None:
        """Write committed positions first_position .. (one row each) into the ring."""
        assert first_position == ring["count"], "the release commits positions in order"
        positions = torch.arange(first_position, first_position + features.shape[0])
        main_x = self.main_x(features)
        for stage in range(self.stages):
            keys = self.context_keys(stage, main_x, positions)
            for row, t in enumerate(positions.tolist()):
                ring["keys"][stage][t % self.window] = keys[row]
        ring["count"] = first_position + features.shape[0]

    def ring_by_position(self, ring: dict, stage: int) -> torch.Tensor:
        """The ring's rows in position order: positions max(0, count - window) .. count - 1."""
        count = ring["count"]
        return torch.stack([ring["keys"][stage][t % self.window] for t in range(max(0, count - self.window), count)])

    # ---- the stages ----
    def attention(self, stage: int, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                  causal: bool = False) -> torch.Tensor:
        """x [T, D] normed stage input at positions [T]; context [C, hd] keys of committed positions.
        Queries see all context rows and all rows of x (causal: only rows j <= i of x, within the window)."""
        heads = self.c["num_attention_heads"]
        q = rms_norm(x @ self.w(stage, "attn.wq_a.weight").t(), self.w(stage, "attn.q_norm.weight"), self.eps)
        q = (q @ self.w(stage, "attn.wq_b.weight").t()).view(-1, heads, self.head_dim)
        q = rotate(rms_norm(q, None, self.eps), positions, self.theta, self.rope_dim)
        kv = rms_norm(x @ self.w(stage, "attn.wkv.weight").t(), self.w(stage, "attn.kv_norm.weight"), self.eps)
        kv = rotate(kv, positions, self.theta, self.rope_dim)
        keys = torch.cat((context, kv))  # [C + T, hd]
        scores = torch.einsum("thd,kd->htk", q, keys) / math.sqrt(self.head_dim)
        if causal:
            t = torch.arange(x.shape[0])
            allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - self.window)
            mask = torch.cat((torch.ones(x.shape[0], context.shape[0], dtype=torch.bool), allowed), dim=1)
            scores = scores.masked_fill(~mask, float("-inf"))
        sink = self.w(stage, "attn.attn_sink").view(heads, 1, 1).expand(heads, x.shape[0], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("htk,kd->thd", probs, keys)
        out = rotate(out, positions, self.theta, self.rope_dim, inverse=True)
        groups, rank = self.c["o_groups"], self.c["o_lora_rank"]
        wo_a = self.w(stage, "attn.wo_a.weight").view(groups, rank, -1)
        low = torch.einsum("tgc,grc->tgr", out.reshape(x.shape[0], groups, -1), wo_a).reshape(x.shape[0], -1)
        return low @ self.w(stage, "attn.wo_b.weight").t()

    def moe(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        """Routed (sqrt-softplus scores, top-k on score + bias, normalised, scaled) + shared SwiGLU experts."""
        limit = self.c["swiglu_limit"]

        def swiglu(prefix: str, h: torch.Tensor) -> torch.Tensor:
            gate = (h @ self.w(stage, f"{prefix}.w1.weight").t()).clamp(max=limit)
            up = (h @ self.w(stage, f"{prefix}.w3.weight").t()).clamp(min=-limit, max=limit)
            return (F.silu(gate) * up) @ self.w(stage, f"{prefix}.w2.weight").t()

        scores = F.softplus(x @ self.w(stage, "ffn.gate.weight").t()).sqrt()
        chosen = (scores + self.w(stage, "ffn.gate.bias")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.c["routed_scaling_factor"]
        out = swiglu("ffn.shared_experts", x)
        for row in range(x.shape[0]):
            for k in range(self.top_k):
                out[row] += weights[row, k] * swiglu(f"ffn.experts.{int(chosen[row, k])}", x[row : row + 1])[0]
        return out

    def _mix(self, stage: int, sub: str, streams: torch.Tensor):
        return sinkhorn_mix(streams.flatten(1), self.w(stage, f"hc_{sub}_fn"), self.w(stage, f"hc_{sub}_base"),
                            self.w(stage, f"hc_{sub}_scale"), self.hc, self.c["hc_sinkhorn_iters"], self.eps,
                            self.hc_eps)

    @staticmethod
    def _collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams).sum(dim=1)

    @staticmethod
    def _expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return post.unsqueeze(-1) * out.unsqueeze(1) + torch.einsum("tij,tid->tjd", comb, streams)

    def stage_v4(self, stage: int, streams: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                 causal: bool = False) -> torch.Tensor:
        pre, post, comb = self._mix(stage, "attn", streams)
        h = rms_norm(self._collapse(streams, pre), self.w(stage, "attn_norm.weight"), self.eps)
        streams = self._expand(streams, self.attention(stage, h, positions, context, causal), post, comb)
        pre, post, comb = self._mix(stage, "ffn", streams)
        h = rms_norm(self._collapse(streams, pre), self.w(stage, "ffn_norm.weight"), self.eps)
        return self._expand(streams, self.moe(stage, h), post, comb)

    def stage_v41(self, stage: int, streams: torch.Tensor, carried: torch.Tensor, positions: torch.Tensor,
                  context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1: the attention collapses with the mix carried in; the FFN with the attention's own pre mix
        (computed from the stage input); the FFN's pre mix is carried out."""
        attn_pre, post, comb = self._mix(stage, "attn", streams)
        h = rms_norm(self._collapse(streams, carried), self.w(stage, "attn_norm.weight"), self.eps)
        streams = self._expand(streams, self.attention(stage, h, positions, context), post, comb)
        ffn_pre, post, comb = self._mix(stage, "ffn", streams)
        h = rms_norm(self._collapse(streams, attn_pre), self.w(stage, "ffn_norm.weight"), self.eps)
        return self._expand(streams, self.moe(stage, h), post, comb), ffn_pre

    def block_causal(self, stage: int, streams: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A V4 stage run as an ordinary causal sliding-window layer on streams [T, hc, D] (harness check)."""
        return self.stage_v4(stage, streams.float(), positions, torch.zeros(0, self.head_dim), causal=True)

    # ---- a draft ----
    def block_tokens(self, anchor: int) -> list[int]:
        return [anchor] + [self.c["dspark_noise_token_id"]] * (self.block_size - 1)

    def draft_hidden(self, ring: dict, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One block of `tokens` at positions count .. count + B - 1 -> (head hidden [B, D], base logits [B, V])."""
        positions = torch.arange(ring["count"], ring["count"] + len(tokens))
        streams = self.t["embed.weight"][torch.tensor(tokens)].unsqueeze(1).repeat(1, self.hc, 1)  # [B, hc, D]
        contexts = [self.ring_by_position(ring, s) for s in range(self.stages)]
        last = self.stages - 1
        if self.v41:
            carried = torch.zeros(len(tokens), self.hc)
            carried[:, 0] = 1.0  # the first block reads stream 0
            for s in range(self.stages):
                streams, carried = self.stage_v41(s, streams, carried, positions, contexts[s])
            hidden = self._collapse(streams, carried)
        else:
            for s in range(self.stages):
                streams = self.stage_v4(s, streams, positions, contexts[s])
            flat = streams.flatten(1)
            mixes = rms_norm(flat, None, self.eps) @ self.w(last, "hc_head_fn").t()
            pre = torch.sigmoid(mixes * self.w(last, "hc_head_scale") + self.w(last, "hc_head_base")) + self.hc_eps
            hidden = self._collapse(streams, pre)
        logits = rms_norm(hidden, self.w(last, "norm.weight"), self.eps) @ self.t["head.weight"].t()
        return hidden, logits

    def markov_greedy(self, base_logits: torch.Tensor, anchor: int, hidden: torch.Tensor):
        """-> (draft tokens [B], corrected logits [B, V], confidences [B])."""
        prev, tokens, corrected, embeddings = anchor, [], [], []
        for i in range(base_logits.shape[0]):
            embedding = self.w1[prev]
            logits = base_logits[i] + self.w2 @ embedding
            prev = int(logits.argmax())
            tokens.append(prev)
            corrected.append(logits)
            embeddings.append(embedding)
        proj = self.w(self.stages - 1, "confidence_head.proj.weight")  # [1, D + r]
        confidence = torch.sigmoid(torch.cat((hidden, torch.stack(embeddings)), dim=-1) @ proj.t()).squeeze(-1)
        return torch.tensor(tokens), torch.stack(corrected), confidence


# ---- the released checkpoint layout ----
LINEAR, NORM, SINK, HC_BASE, HC_SCALE, GATE_BIAS = "linear", "norm", "sink", "hc_base", "hc_scale", "gate_bias"


def released_layout(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every DSpark tensor of a release with this config: native name -> (shape, init kind).

    Per stage s, `mtp.{s}.` + one sliding-attention, routed-MoE block; `mtp.0.main_proj` [D, D * n] and
    `main_norm`; the last stage's `norm`, `hc_head_{fn,base,scale}` (V4-Flash-DSpark only),
    `markov_head.markov_w1` / `markov_w2` [V, r] (V4.1: `markov_head.embed` / `markov_head.head`) and
    `confidence_head.proj` [1, D + r]. The embedding and head are the target's."""
    d, hc, hd, heads = config["hidden_size"], config["hc_mult"], config["head_dim"], config["num_attention_heads"]
    ql, groups, ol = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    inter, vocab, rank = config["moe_intermediate_size"], config["vocab_size"], config["dspark_markov_rank"]
    v41 = any(key in config for key in V41_FIELDS)
    experts = config.get("dspark_n_routed_experts", config["n_routed_experts"])
    mix = (2 + hc) * hc
    stages = config["n_mtp_layers"]
    layout: dict[str, tuple[tuple[int, ...], str]] = {}
    for s in range(stages):
        p = f"mtp.{s}."
        block = {
            "attn.wq_a.weight": ((ql, d), LINEAR), "attn.q_norm.weight": ((ql,), NORM),
            "attn.wq_b.weight": ((heads * hd, ql), LINEAR), "attn.wkv.weight": ((hd, d), LINEAR),
            "attn.kv_norm.weight": ((hd,), NORM), "attn.wo_a.weight": ((groups * ol, heads * hd // groups), LINEAR),
            "attn.wo_b.weight": ((d, groups * ol), LINEAR), "attn.attn_sink": ((heads,), SINK),
            "attn_norm.weight": ((d,), NORM), "ffn_norm.weight": ((d,), NORM),
            "ffn.gate.weight": ((experts, d), LINEAR), "ffn.gate.bias": ((experts,), GATE_BIAS),
            "ffn.shared_experts.w1.weight": ((inter, d), LINEAR), "ffn.shared_experts.w3.weight": ((inter, d), LINEAR),
            "ffn.shared_experts.w2.weight": ((d, inter), LINEAR),
        }
        for sub in ("attn", "ffn"):
            block[f"hc_{sub}_fn"] = ((mix, hc * d), LINEAR)
            block[f"hc_{sub}_base"] = ((mix,), HC_BASE)
            block[f"hc_{sub}_scale"] = ((3,), HC_SCALE)
        for e in range(experts):
            block[f"ffn.experts.{e}.w1.weight"] = ((inter, d), LINEAR)
            block[f"ffn.experts.{e}.w3.weight"] = ((inter, d), LINEAR)
            block[f"ffn.experts.{e}.w2.weight"] = ((d, inter), LINEAR)
        if s == 0:
            block["main_proj.weight"] = ((d, d * len(config["dspark_target_layer_ids"])), LINEAR)
            block["main_norm.weight"] = ((d,), NORM)
        if s == stages - 1:
            block["norm.weight"] = ((d,), NORM)
            if not v41:
                block["hc_head_fn"] = ((hc, hc * d), LINEAR)
                block["hc_head_base"] = ((hc,), HC_BASE)
                block["hc_head_scale"] = ((1,), HC_SCALE)
            w1, w2 = ("embed", "head") if v41 else ("markov_w1", "markov_w2")
            block[f"markov_head.{w1}.weight"] = ((vocab, rank), LINEAR)
            block[f"markov_head.{w2}.weight"] = ((vocab, rank), LINEAR)
            block["confidence_head.proj.weight"] = ((1, d + rank), LINEAR)
        layout.update({p + name: spec for name, spec in block.items()})
    return layout


def released_dspark_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """fp32 values for `released_layout(config)`, seeded: linear weights N(0,1)/sqrt(fan_in), norms
    1 + 0.1 N, sinks N(0,1), mHC base 0.5 N and scale U(0.5, 1.5), router bias 0.1 N."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, kind) in sorted(released_layout(config).items()):
        normal = torch.randn(shape, generator=generator)
        if kind == LINEAR:
            value = normal / math.sqrt(shape[-1])
        elif kind == NORM:
            value = 1.0 + 0.1 * normal
        elif kind == SINK:
            value = normal
        elif kind == HC_BASE:
            value = 0.5 * normal
        elif kind == HC_SCALE:
            value = 0.5 + torch.rand(shape, generator=generator)
        else:
            value = 0.1 * normal
        tensors[name] = value
    return tensors


# How the releases store the drafter: block-FP8 dense linears (main_proj included) with their `.scale`, routed
# experts FP4 (int8 + ue8m0) or, in -Base releases, block FP8 with fp32 scales; mHC, sinks and router bias
# fp32; everything else (norms, router weight, Markov and confidence heads) bf16.
_STORED_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|main_proj)\.weight$")
_STORED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_STORED_FP32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|\.attn_sink|\.gate\.bias)$")


def released_storage(tensors: dict[str, torch.Tensor], expert_dtype: str = "fp4") -> dict[str, torch.Tensor]:
    """fp32 drafter tensors -> what a release's safetensors hold (names and dtypes), quantized with the test
    suite's own quantizer (tests/reference.py): ue8m0 scales with FP4 experts, fp32 scales with FP8 ones."""
    scale_fmt = ref.UE8M0 if expert_dtype == "fp4" else ref.FLOAT
    stored = {}
    for name, value in tensors.items():
        scale_name = name.removesuffix(".weight") + ".scale"
        if _STORED_EXPERT.search(name):
            q, scale = ref.quantize_fp4(value) if expert_dtype == "fp4" else ref.quantize_fp8_block(value, ref.FLOAT)
            stored[name], stored[scale_name] = q, scale
        elif _STORED_FP8.search(name):
            stored[name], stored[scale_name] = ref.quantize_fp8_block(value, scale_fmt)
        elif _STORED_FP32.search(name):
            stored[name] = value.float()
        else:
            stored[name] = value.to(torch.bfloat16)
    return stored


def stored_values(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 values a stored release holds (dequantized with tests/reference.py), under the weight names."""
    values = {}
    for name, tensor in stored.items():
        if name.endswith(".scale"):
            continue
        scale = stored.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            values[name] = tensor.float()
        elif tensor.dtype == torch.float8_e4m3fn:
            values[name] = ref.dequantize_fp8_block(tensor, scale)
        else:
            values[name] = ref.dequantize_fp4(tensor, scale)
    return values
