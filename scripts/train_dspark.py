#!/usr/bin/env python3
"""Train a DSpark drafter for the embedded model and write the DSpark variant checkpoint.

    python scripts/train_dspark.py                    # the shipped run, on the final dsv4-sort target
    python scripts/train_dspark.py --smoke --out /tmp/x   # seconds: CI keeps the objective and writer working

The target (default: the embedded `dsv4-sort`, loaded from its shipped FP8 / FP4 files) stays frozen: like
DeepSeek, DSpark is trained after the backbone, on its features, never back-propagating into it. Each
training sequence is a digit-sorting example; every answer position a (a generated token, as at serving
time) is an anchor:

    context   the target's features of positions < a (the last sliding_window of them), as context keys
    block     [x_a, noise x (B-1)] at positions a .. a+B-1, through the drafter's stages in one pass
    labels    x_{a+1} .. x_{a+B}; masked past the sequence end, and after any masked position (a draft
              prefix cannot survive a gap)
    logits_k  base_k + W2 @ W1[prev_k], prev teacher-forced: the anchor, then the true tokens
    p_k       the target's own next-token distribution at position a+k (what verification accepts against)

The objective is DeepSpec's DSpark loss (deepspec/modeling/dspark/loss.py), per position weighted by
exp(-k / gamma) (early positions matter most: a draft is only as long as its accepted prefix):

    ce_alpha * CE(logits_k, x_{a+k+1})  +  l1_alpha * || softmax(logits_k) - p_k ||_1
    +  conf_alpha * BCE(confidence logit_k, 1 - 0.5 || softmax(logits_k) - p_k ||_1  (no gradient))

(1 - half the L1 distance is the probability that rejection sampling accepts a draft from q_k when the
target samples p_k: the confidence head learns to predict exactly that.)

Output (under --out): dsv4-sort-dspark/, DeepSeek's native layout (FP8 e4m3 dense weights with ue8m0 block
scales, FP4 routed experts), the target's tensors re-encoded bit-exactly plus the `mtp.{s}.*` DSpark
tensors, and a config with the dspark_* fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import dsv4  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsv4.config import DSparkConfig, ModelConfig
from dsv4.embedded import DEFAULT_MODEL, resolve_model
from dsv4.engine.llm import resolve_dtype
from dsv4.kernels.registry import KernelRegistry
from dsv4.model.batch import ForwardBatch
from dsv4.model.deepseek_v4 import broadcast_fn
from dsv4.model.dspark import DSparkDrafter, StageContext
from dsv4.model.moe import DENSE
from dsv4.tasks import sort_digits as task
from dsv4.weights.export import RESIDENT, iter_weights, save_checkpoint
from dsv4.weights.loader import LoadedModels, load_models
from dsv4.weights.routes import RouteTable
from dsv4.weights.slots import SlotTable
from dsv4.weights.writer import WeightWriter

OUT_NAME = "dsv4-sort-dspark"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "dsv4" / "embedded"
_HIDDEN = float("-inf")


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """DeepSpec's defaults for DSpark (config/dspark/dspark_qwen3_4b_online.py)."""

    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay_gamma: float = 4.0  # position k weighs exp(-k / gamma)


@dataclasses.dataclass(frozen=True)
class DSparkLoss:
    total: torch.Tensor
    ce: float
    l1: float
    confidence: float
    accept: list[float]  # mean acceptance probability per block position (1 - TV(q, p))
    expected_accepted: float  # mean over blocks of sum_k prod_{j <= k} accept_j: drafts accepted per step


def _anchors(seqs: list[tuple[list[int], int]], segments) -> list[tuple[int, int, int]]:
    """(sequence, anchor position, flat row of the anchor) for every answer position with a next token."""
    out = []
    for i, ((ids, answer_start), seg) in enumerate(zip(seqs, segments)):
        out.extend((i, a, seg.begin + a) for a in range(answer_start, len(ids) - 1))
    return out


def dspark_objective(
    target, drafter: DSparkDrafter, examples: list[task.Example], weights: LossWeights
) -> DSparkLoss:
    """The DSpark training loss on a batch of examples (module docstring). Differentiable in the drafter's
    parameters; the target runs without gradient."""
    seqs = [task.training_ids(ex) for ex in examples]
    batch = ForwardBatch.build([(i, ids, 0) for i, (ids, _) in enumerate(seqs)])
    longest = max(len(ids) for ids, _ in seqs)
    streams, captured = target(batch, target.allocate_cache(len(seqs), longest), capture_layers=drafter.capture_layers)
    target_probs = target.logits(streams).softmax(dim=-1)  # [T, V]: row t is p(x_{t+1} | x_{<=t})
    keys = drafter.context_keys(drafter.features(captured, batch.token_ids).detach(), batch.positions)

    block, window = drafter.spec.block_size, drafter.cfg.sliding_window
    anchors = _anchors(seqs, batch.segments)
    n = len(anchors)
    seq_of = torch.tensor([i for i, _, _ in anchors])
    pos = torch.tensor([a for _, a, _ in anchors])
    row = torch.tensor([r for _, _, r in anchors])
    # context: positions a - window .. a - 1 of the anchor's own sequence (rows before 0 hidden)
    offsets = torch.arange(window) - window
    ctx_pos = pos.unsqueeze(1) + offsets  # [N, window]
    ctx_visible = ctx_pos >= 0
    seq_begin = torch.tensor([batch.segments[i].begin for i in seq_of.tolist()])
    ctx_rows = (seq_begin.unsqueeze(1) + ctx_pos.clamp(min=0)).reshape(-1)
    ctx_bias = torch.zeros(n, window).masked_fill(~ctx_visible, _HIDDEN)
    contexts = [StageContext(k.index_select(0, ctx_rows).view(n, window, -1), ctx_bias) for k in keys]

    # labels x_{a+1} .. x_{a+B}, valid while inside the sequence (and every earlier one valid)
    ends = torch.tensor([batch.segments[i].end for i in seq_of.tolist()])
    label_rows = row.unsqueeze(1) + 1 + torch.arange(block)  # [N, B]
    valid = (label_rows < ends.unsqueeze(1)).int().cumprod(dim=-1).bool()
    safe_rows = torch.where(valid, label_rows, row.unsqueeze(1))
    labels = batch.token_ids[safe_rows]
    prev = torch.cat((batch.token_ids[row].unsqueeze(1), labels[:, :-1]), dim=1)  # teacher-forced Markov input

    anchor_tokens = batch.token_ids[row]
    fn_broadcast = broadcast_fn(drafter.mtp[0].hc_attn_fn.float(), drafter.cfg.hc_mult)  # live: gradient flows
    hidden, base = drafter.forward(drafter.draft_blocks(anchor_tokens, pos), contexts, first_layer_fn=fn_broadcast)
    last = drafter.mtp[-1]
    embedding = last.markov_head.markov_w1(prev)
    logits = base + last.markov_head.bias(embedding)  # [N, B, V] fp32
    p = target_probs[safe_rows - 1]  # p(x_{a+k+1} | x_{<=a+k})
    q = logits.softmax(dim=-1)
    l1 = (q - p).abs().sum(dim=-1)  # [N, B]
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    confidence_logits = last.confidence_head(hidden, embedding)

    decay = torch.exp(-torch.arange(block, dtype=torch.float32) / weights.decay_gamma)
    w = valid.float() * decay
    denominator = w.sum().clamp(min=1.0)
    ce = (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
          .view(n, block) * w).sum() / denominator
    l1_loss = (l1 * w).sum() / denominator
    bce = (F.binary_cross_entropy_with_logits(confidence_logits, accept.detach(), reduction="none") * w).sum()
    bce = bce / denominator
    total = weights.ce * ce + weights.l1 * l1_loss + weights.confidence * bce
    with torch.no_grad():
        survive = (accept * valid).cumprod(dim=-1)
        per_position = [float(((accept * valid)[:, k]).sum() / valid[:, k].sum().clamp(min=1)) for k in range(block)]
    return DSparkLoss(total, ce.item(), l1_loss.item(), bce.item(), per_position, survive.sum(-1).mean().item())


# ---------------------------------------------------------------------------------------------------
def init_drafter(drafter: DSparkDrafter, seed: int) -> None:
    """Every drafter tensor, seeded by name order: norms and mHC scales 1, biases / sinks 0, mHC and head
    projections small, other projections N(0, 1/fan_in) (output projections scaled by depth); the Markov
    bias starts at zero (W2 = 0) and the confidence at 0.5, so both begin neutral."""
    gen = torch.Generator().manual_seed(seed)
    depth_scale = (2 * len(drafter.mtp)) ** -0.5
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or ("hc_" in name and name.endswith("_scale")):
                p.fill_(1.0)
            elif name.endswith(("_base", "attn_sink", "gate.bias", "markov_w2.weight", "confidence_head.proj.weight")):
                p.zero_()
            elif "hc_" in name and name.endswith("_fn"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
            else:
                std = p.shape[-1] ** -0.5
                if name.endswith((".wo_b.weight", ".w2.weight", ".experts.w2")):
                    std *= depth_scale
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def export_drafter(trained: DSparkDrafter, loaded: LoadedModels) -> DSparkDrafter:
    """The trained (fp32, dense-expert) drafter rebuilt beside `loaded`'s target, in its dtype and expert
    format, through the loader's own writer (which converts and quantizes), finalized: what the checkpoint
    ships."""
    shipped = DSparkDrafter(trained.cfg, loaded.target, loaded.expert_format, loaded.target.dtype)
    table = SlotTable({"dspark": shipped})
    writer = WeightWriter(RouteTable(table), loaded.layout)
    for name, tensor in iter_weights(LoadedModels(trained.cfg, {"dspark": trained}, loaded.layout, DENSE, "trained")):
        writer.load(name, tensor, "trained drafter")
    writer.check_complete(table.names(), "trained drafter")
    shipped.process_weights_after_loading()
    return shipped


def dspark_config(cfg: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    layers = tuple(args.target_layers) if args.target_layers else tuple(range(cfg.num_hidden_layers))
    spec = DSparkConfig(block_size=args.block_size, noise_token_id=args.noise_token, target_layer_ids=layers,
                        markov_rank=args.markov_rank, num_stages=args.stages)
    # round trip through the parser: every field validated as a checkpoint's would be
    return ModelConfig.from_dict(dataclasses.replace(cfg, dspark=spec).to_native_dict(), source="train_dspark")


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path, _ = resolve_model(args.model, "auto")
    # The frozen target, experts resident as shipped. The fast paths are inference kernels without a
    # backward: the target and the drafter (which shares its registry) train through the torch reference.
    loaded = load_models(path, dtype=torch.float32, kernels=KernelRegistry(force_reference=True))
    target = loaded.target
    cfg = dspark_config(loaded.config, args)
    with torch.device("cpu"):
        drafter = DSparkDrafter(cfg, target, DENSE, torch.float32)
    init_drafter(drafter, args.seed)
    drafter.process_weights_after_loading()  # READY (training computes the broadcast matrix live)
    drafter.train()
    params = [p for p in drafter.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, min(args.warmup, args.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    weights = LossWeights()
    held_out = task.examples(args.eval_n, seed=args.seed + 1_000_003)
    log, t0 = [], time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = dspark_objective(target, drafter, [task.sample(rng) for _ in range(args.batch)], weights)
        opt.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            entry = {"step": step, "loss": round(loss.total.item(), 4), "ce": round(loss.ce, 4),
                     "l1": round(loss.l1, 4), "conf": round(loss.confidence, 4),
                     "expected_accepted": round(loss.expected_accepted, 3), "elapsed_s": round(time.time() - t0, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
    drafter.requires_grad_(False)
    drafter.eval()
    drafter.process_weights_after_loading()
    with torch.no_grad():
        held = dspark_objective(target, drafter, held_out, weights)
    out = Path(args.out) / OUT_NAME
    # The target again in the checkpoint's own dtype (bf16 for the shipped model), so the variant stores it
    # exactly as the original does.
    stored = load_models(path, dtype=resolve_dtype("auto", loaded.config))
    shipped = export_drafter(drafter, stored)
    both = LoadedModels(cfg, {"target": stored.target, "dspark": shipped}, stored.layout, stored.expert_format,
                        stored.load_format)
    # experts "resident": the target's FP4 bytes exactly as shipped, the drafter's as just quantized
    save_checkpoint(both, out, layout="native", dense="fp8", experts=RESIDENT, copy_from=path)
    summary = {"train_seconds": round(time.time() - t0, 1), "steps": args.steps, "batch": args.batch,
               "first_loss": log[0]["loss"], "final_loss": log[-1]["loss"],
               "held_out_accept_per_position": [round(a, 3) for a in held.accept],
               "held_out_expected_accepted": round(held.expected_accepted, 3), "out": str(out)}
    print(json.dumps(summary), flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target: an embedded model's name or a directory")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"directory that receives {OUT_NAME}/")
    p.add_argument("--block-size", type=int, default=5)
    p.add_argument("--stages", type=int, default=1, help="drafter blocks (the release has 3 for a 43-layer target)")
    p.add_argument("--target-layers", type=int, nargs="*", help="target layers read (default: all of them)")
    p.add_argument("--markov-rank", type=int, default=16)
    p.add_argument("--noise-token", type=int, default=task.UNK_ID, help="the block's filler token (never in the task)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these tiny ops)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (CI): few steps, tiny batch")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.eval_n, args.log_every = 3, 4, 4, 1
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return train(args)


if __name__ == "__main__":
    main()
