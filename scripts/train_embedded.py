#!/usr/bin/env python3
"""Train the embedded default model (`dsv4-sort`) and write it in both shipped forms.

    python scripts/train_embedded.py                 # the shipped run: 800 steps x 64 examples, seed 0
                                                     # (985 s on a shared 2-core box, 1 torch thread;
                                                     #  held-out accuracy 1.0 from step ~600)
    python scripts/train_embedded.py --smoke --out /tmp/x   # seconds: CI keeps this script working

The model is a small DeepSeek-V4 (every attention type: sliding, CSA, HCA; hash-routed and top-k MoE;
mHC; one MTP layer) trained with dsv4's own model code on the digit-sorting task of
`dsv4.tasks.sort_digits`: `sort 31402=` -> `01234`. The target learns next-token prediction of the
answer; the MTP layer learns the next-next token from the target's pre-hc_head stream (jointly, its
loss also flows into the trunk, as in DeepSeek's recipe).

Outputs (under --out, default src/dsv4/embedded):
  dsv4-sort-bf16/  the trained weights in bf16, transformers' HF layout (stacked experts), HF config
  dsv4-sort/       DeepSeek's native release layout: FP8 e4m3 dense weights with ue8m0 128x128 block
                   scales, FP4 routed experts (int8 packed, ue8m0 scales per 32 inputs), native config
                   with quantization_config; this is the package's default model
Both get the same character-level tokenizer.json and tokenizer_config.json (special tokens and the
chat template of `dsv4.tasks.sort_digits`). Quantization uses `dsv4.quant`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

try:
    import dsv4  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from safetensors.torch import save_file

from dsv4.config import ModelConfig, QuantConfig
from dsv4.kernels.registry import KernelRegistry
from dsv4.model.batch import ForwardBatch
from dsv4.model.deepseek_v4 import DeepseekV4, broadcast_fn, hyper_head
from dsv4.model.drafters import MTPDrafter
from dsv4.quant import quantize_fp4, quantize_fp8_blockwise
from dsv4.tasks import sort_digits as task
from dsv4.weights.loader import build_models
from dsv4.weights.names import to_hf_name

NATIVE_NAME = "dsv4-sort"
BF16_NAME = "dsv4-sort-bf16"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "dsv4" / "embedded"

# The model, in transformers' spelling (ModelConfig.from_dict reads it; the writers respell it).
MODEL_CONFIG = {
    "model_type": "deepseek_v4",
    "vocab_size": len(task.VOCAB),
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.5,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 64,
    "num_nextn_predict_layers": 1,
    "bos_token_id": task.BOS_ID,
    "eos_token_id": task.EOS_ID,
}
MTP_LOSS_WEIGHT = 0.3


# ---------------------------------------------------------------------------------------------------
# initialisation
# ---------------------------------------------------------------------------------------------------
_OUTPUT_PROJECTIONS = (".wo_b.weight", ".w2.weight", ".experts.w2")


def init_weights(models: dict, cfg: ModelConfig, seed: int) -> None:
    """Every tensor of the target and the MTP drafter, seeded by name order."""
    gen = torch.Generator().manual_seed(seed)
    depth_scale = (2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)) ** -0.5
    with torch.no_grad():
        for role in sorted(models):
            for name, p in models[role].named_parameters():
                if p.dtype == torch.int32:  # hash routing table: k distinct expert ids per token
                    rows, k = p.shape
                    ids = torch.rand(rows, cfg.n_routed_experts, generator=gen).argsort(dim=-1)[:, :k]
                    p.copy_(ids.to(torch.int32))
                elif name.endswith("norm.weight") or ("hc_" in name and name.endswith("_scale")):
                    p.fill_(1.0)  # RMSNorm weights; mHC coefficient scales
                elif name.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
                    p.zero_()
                elif "hc_" in name and name.endswith("_fn"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
                elif name == "embed.weight":
                    p.copy_(torch.randn(p.shape, generator=gen))
                else:  # projections [.., out, in]
                    std = p.shape[-1] ** -0.5
                    if name.endswith(_OUTPUT_PROJECTIONS):
                        std *= depth_scale
                    p.copy_(torch.randn(p.shape, generator=gen) * std)


# ---------------------------------------------------------------------------------------------------
# differentiable forward (the model's own modules; the first layer's broadcast matrix from the live
# hc_attn_fn, so the trained value and the derived tensor finalize recomputes are the same function)
# ---------------------------------------------------------------------------------------------------
def target_streams(model: DeepseekV4, batch: ForwardBatch, cache) -> torch.Tensor:
    embeds = model.embed(batch.token_ids)
    fn_broadcast = broadcast_fn(model.layers[0].hc_attn_fn.float(), model.cfg.hc_mult)
    streams = model.layers[0].forward_broadcast(embeds, fn_broadcast, batch, cache[0])
    for i in range(1, len(model.layers)):
        streams = model.layers[i](streams, batch, cache[i])
    return streams


def target_logits(model: DeepseekV4, streams: torch.Tensor) -> torch.Tensor:
    return model.head(model.norm(hyper_head(model, streams, model.cfg))).float()


def mtp_logits(mtp: MTPDrafter, batch: ForwardBatch, streams: torch.Tensor, cache) -> torch.Tensor:
    return MTPDrafter.forward.__wrapped__(mtp, batch, streams, cache)[1]


def make_batch(examples: list[task.Example]):
    """-> target batch, MTP batch, index tensors and labels for both losses."""
    seqs = [task.training_ids(ex) for ex in examples]
    batch = ForwardBatch.build([(i, ids, 0) for i, (ids, _) in enumerate(seqs)])
    # MTP: the stream at t with token t+1 (run at position t) predicts token t+2.
    mtp_batch = ForwardBatch.build([(i, ids[1:], 0) for i, (ids, _) in enumerate(seqs)])
    rows, labels, mtp_src, mtp_rows, mtp_labels = [], [], [], [], []
    for seg, mseg, (ids, answer_start) in zip(batch.segments, mtp_batch.segments, seqs):
        for t in range(answer_start - 1, len(ids) - 1):
            rows.append(seg.begin + t)
            labels.append(ids[t + 1])
        mtp_src.extend(range(seg.begin, seg.end - 1))
        for t in range(max(answer_start - 2, 0), len(ids) - 2):
            mtp_rows.append(mseg.begin + t)
            mtp_labels.append(ids[t + 2])
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)
    return batch, mtp_batch, as_long(rows), as_long(labels), as_long(mtp_src), as_long(mtp_rows), as_long(mtp_labels)


def train_step(target: DeepseekV4, mtp: MTPDrafter, examples: list[task.Example]):
    batch, mtp_batch, rows, labels, mtp_src, mtp_rows, mtp_labels = make_batch(examples)
    seq_len = max(s.length for s in batch.segments) + 1
    streams = target_streams(target, batch, target.allocate_cache(len(examples), seq_len))
    loss = torch.nn.functional.cross_entropy(target_logits(target, streams[rows]), labels)
    draft = mtp_logits(mtp, mtp_batch, streams[mtp_src], mtp.allocate_cache(len(examples), seq_len))
    mtp_loss = torch.nn.functional.cross_entropy(draft[mtp_rows], mtp_labels)
    return loss, mtp_loss


# ---------------------------------------------------------------------------------------------------
# greedy check with the training-time models (teacher-free: generate token by token, full recompute)
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def quick_accuracy(target: DeepseekV4, examples: list[task.Example]) -> float:
    ids = [[task.BOS_ID, *task.encode(ex.prompt)] for ex in examples]
    out = [[] for _ in examples]
    done = [False] * len(examples)
    for _ in range(task.MAX_DIGITS + 1):
        seqs = [p + o for p, o in zip(ids, out)]
        batch = ForwardBatch.build([(i, s, 0) for i, s in enumerate(seqs)])
        streams = target_streams(target, batch, target.allocate_cache(len(seqs), max(map(len, seqs)) + 1))
        nxt = target_logits(target, streams[batch.last_token_indices]).argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            if not done[i]:
                if tok == task.EOS_ID:
                    done[i] = True
                else:
                    out[i].append(tok)
    texts = ["".join(task.VOCAB[t] if t >= len(task.SPECIALS) else "?" for t in o) for o in out]
    return sum(task.is_correct(ex.prompt, t) and d for ex, t, d in zip(examples, texts, done)) / len(examples)


# ---------------------------------------------------------------------------------------------------
# writers
# ---------------------------------------------------------------------------------------------------
# Dense 2-D weights DeepSeek's release stores as FP8 (attention, compressor, indexer, shared expert and
# MTP projections); embedding, head, router, norms, mHC and sink/ape tensors stay in bf16 / fp32.
_FP8_SUFFIXES = (
    ".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wgate.weight", ".wo_a.weight", ".wo_b.weight",
    ".weights_proj.weight", ".shared_experts.w1.weight", ".shared_experts.w2.weight",
    ".shared_experts.w3.weight", ".e_proj.weight", ".h_proj.weight",
)
_FP32_SUFFIXES = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")


def native_tensors(models: dict) -> dict[str, torch.Tensor]:
    """Every tensor under its native name, float values as trained (fp32), experts split per expert."""
    out: dict[str, torch.Tensor] = {}
    for role in ("target", "mtp"):
        model = models[role]
        for pname, p in model.named_parameters():
            t = p.detach()
            if pname.endswith((".experts.w1", ".experts.w2", ".experts.w3")):
                prefix, w = pname.rsplit(".", 1)
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.{w}.weight"] = t[e].contiguous()
            else:
                out[pname] = t.contiguous()
    return out


def _stored_float(name: str, t: torch.Tensor) -> torch.Tensor:
    """bf16 for weights, fp32 for the small mHC / sink / bias vectors (as DeepSeek's releases store them)."""
    return t.float() if name.endswith(_FP32_SUFFIXES) else t.to(torch.bfloat16)


def write_native(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path) -> None:
    quant = QuantConfig(weight_block_size=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    block = quant.weight_block_size
    files: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dtype == torch.int32:
            files[name] = t
        elif ".experts." in name:
            packed, scale = quantize_fp4(t, quant.fp4_group_size)
            files[name] = packed.view(torch.int8)
            files[name[: -len(".weight")] + ".scale"] = scale.view(torch.float8_e8m0fnu)
        elif name.endswith(_FP8_SUFFIXES):
            q, scale = quantize_fp8_blockwise(t, block, quant.scale_fmt)
            files[name] = q
            files[name[: -len(".weight")] + ".scale"] = scale.view(torch.float8_e8m0fnu)
        else:
            files[name] = _stored_float(name, t)
    native_cfg = _replace_dtype(cfg.with_quant(quant), "bfloat16").to_native_dict()
    _write_dir(out_dir, files, native_cfg)


def write_hf_bf16(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path) -> None:
    """transformers' layout: HF names, experts stacked per layer (gate_up_proj [E, 2I, D], down_proj
    [E, D, I]). MTP tensors have no HF spelling of their own: they keep their native names."""
    files: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if name.startswith("layers.") and parts[2:4] == ["ffn", "experts"]:
            prefix = ".".join(parts[:4])  # layers.{i}.ffn.experts
            experts.setdefault(prefix, {}).setdefault(int(parts[4]), {})[parts[5]] = t
            continue
        stored = t if t.dtype == torch.int32 else _stored_float(name, t)
        hf_named = name.startswith(("layers.", "embed.", "head.", "norm.", "hc_head"))
        files[to_hf_name(name) if hf_named else name] = stored
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        gate_up = torch.stack([torch.cat((by_expert[e]["w1"], by_expert[e]["w3"])) for e in order])
        down = torch.stack([by_expert[e]["w2"] for e in order])
        hf_prefix = "model." + prefix.replace(".ffn.", ".mlp.")
        files[f"{hf_prefix}.gate_up_proj"] = gate_up.to(torch.bfloat16).contiguous()
        files[f"{hf_prefix}.down_proj"] = down.to(torch.bfloat16).contiguous()
    _write_dir(out_dir, files, _replace_dtype(cfg.with_quant(None), "bfloat16").to_hf_dict())


def _replace_dtype(cfg: ModelConfig, dtype: str) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, torch_dtype=dtype)


def _write_dir(out_dir: Path, files: dict[str, torch.Tensor], config: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.safetensors"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in sorted(files.items())}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # save_file creates 0600; package data must be readable
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    task.build_tokenizer().save(str(out_dir / "tokenizer.json"))
    write_tokenizer_config(out_dir)


def write_tokenizer_config(out_dir: Path) -> None:
    """tokenizer_config.json with the task's chat template, so that `LLM.chat` works on the shipped models."""
    (out_dir / "tokenizer_config.json").write_text(json.dumps(task.tokenizer_config(), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = ModelConfig.from_dict(dict(MODEL_CONFIG), source="train_embedded.MODEL_CONFIG")
    # The fast paths are inference kernels without a backward: train through the torch reference.
    models = build_models(cfg, "dense", torch.float32, "cpu", draft="mtp", kernels=KernelRegistry(force_reference=True))
    target, mtp = models["target"], models["mtp"]
    init_weights(models, cfg, args.seed)
    params = []
    for model in (target, mtp):
        model.train()
        model.process_weights_after_loading()  # READY (the training forward computes the derived matrix live)
        for p in model.parameters():
            if p.is_floating_point():
                p.requires_grad_(True)
                params.append(p)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98),
    )
    warmup = max(1, min(args.warmup, args.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    held_out = task.examples(args.eval_n, seed=args.seed + 1_000_003)
    t0 = time.time()
    log = []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss, mtp_loss = train_step(target, mtp, [task.sample(rng) for _ in range(args.batch)])
        opt.zero_grad(set_to_none=True)
        (loss + MTP_LOSS_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            entry = {"step": step, "loss": round(loss.item(), 4), "mtp_loss": round(mtp_loss.item(), 4),
                     "elapsed_s": round(time.time() - t0, 1)}
            if args.eval_every and step and (step % args.eval_every == 0 or step == args.steps - 1):
                target.eval()
                entry["acc"] = quick_accuracy(target, held_out)
                target.train()
            log.append(entry)
            print(json.dumps(entry), flush=True)
    train_s = time.time() - t0
    for model in (target, mtp):
        model.requires_grad_(False)
        model.eval()
        model.process_weights_after_loading()
    acc = quick_accuracy(target, held_out)
    tensors = native_tensors(models)
    out = Path(args.out)
    write_hf_bf16(tensors, cfg, out / BF16_NAME)
    write_native(tensors, cfg, out / NATIVE_NAME)
    summary = {"train_seconds": round(train_s, 1), "steps": args.steps, "batch": args.batch,
               "fp32_accuracy": acc, "final_loss": log[-1]["loss"], "final_mtp_loss": log[-1]["mtp_loss"]}
    print(json.dumps(summary), flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory that receives the two model folders")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these tiny ops)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (CI): few steps, tiny batch")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.eval_every, args.eval_n, args.log_every = 3, 4, 0, 4, 1
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return train(args)


if __name__ == "__main__":
    main()
