#!/usr/bin/env python3
"""GRPO on the embedded digit-sorting task: a transformers trainer and a dsv4 rollout engine in two
processes, the engine refit over torch.distributed (gloo) after every optimizer step.

    python examples/grpo_sort.py                                  # fp32 engine, experts dense (the trainer's)
    python examples/grpo_sort.py --engine-dtype bfloat16          # bf16 engine
    python examples/grpo_sort.py --engine-dtype bfloat16 --activation-dtype float32  # bf16 weights, fp32 math
    python examples/grpo_sort.py --expert-dtype fp4               # FP4 experts, quantized at every refit
    python examples/grpo_sort.py --steps 3 --prompts 4 --group 4  # a quick look

The trainer (this process, rank 0 of the transfer group) is a transformers `DeepseekV4ForCausalLM` in fp32,
loaded from the embedded bf16 model `dsv4-sort-bf16` and then deliberately weakened: every matrix gets
seeded Gaussian noise of `--weaken` times its own standard deviation (0.5 takes held-out greedy accuracy
from 1.0 to about 0.3-0.4). The rollout engine (a spawned process, rank 1) is `dsv4.LLM` on the same
embedded model; it joins the group with `init_weight_transfer`, receives the weakened weights, then after
every step `update_weights_from_distributed(meta)` while the trainer runs `WeightSender.send`.

One step: sample a group of `--group` completions (temperature 1, raw logprobs) for each of `--prompts`
fresh prompts; reward 1 for an exact sort followed by end of sequence, else 0; advantage = reward minus
the group's mean, divided by the group's std (+ a small epsilon; a group that all agrees teaches nothing);
the trainer recomputes the logprobs of the sampled tokens (sequences of one length batched together, no
padding) under the weights the engine used, logs their agreement with the engine's (`dsv4.rl.agreement`), and takes one
AdamW step on the GRPO policy-gradient loss (sequence-mean of -advantage * logprob, batch mean; one update
per batch, so the PPO ratio is 1 and needs no clipping; no KL penalty). Then the new weights go to the
engine, based on the version it holds.

An engine whose dense weights are narrower than the trainer's (bf16) also gets `resident_*` agreement per
step: against the trainer's logprobs under its own weights rounded as the engine holds them
(`resident_trainer`). That leaves out the weight rounding, so it measures only what the engine computes
differently: with `--activation-dtype float32` it is fp32 rounding (the remaining gap is the weights'
rounding), with bf16 activations it is what bf16 arithmetic adds.

What "learns" means here (seeded; checked and reported as "learned" in the JSON): the mean reward of the
last 10 steps exceeds that of the first 5 by at least `REWARD_RISE` (0.2), and held-out greedy accuracy
(64 prompts no training step sees) rises. The run writes a JSON (per-step reward, agreement, sync times)
and a plot of reward and agreement per step. Needs transformers (the `test` extra) and, for the plot,
matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import random
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

try:
    import dsv4  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsv4.embedded import BF16_MODEL, resolve_model
from dsv4.rl import WeightSender, agreement
from dsv4.tasks import sort_digits as task

RESULTS = Path(__file__).resolve().parent / "results"
REWARD_RISE = 0.2  # last-10-step mean reward minus first-5-step mean, for the run to count as learning
FIRST_STEPS, LAST_STEPS = 5, 10
ADVANTAGE_EPS = 1e-4  # keeps a group's advantages finite when its rewards barely differ
EVAL_SEED = 1_000_003  # held-out prompts: a seed no training step draws from
ENGINE_RANK, WORLD_SIZE = 1, 2


@dataclass(frozen=True)
class GRPOConfig:
    """One run. The defaults are the recorded run (examples/results/)."""

    steps: int = 60
    prompts: int = 16  # fresh prompts per step
    group: int = 8  # completions per prompt
    lr: float = 2e-4
    weaken: float = 0.5  # noise std, relative to each matrix's own std
    seed: int = 0
    engine_dtype: str = "float32"
    activation_dtype: str | None = None  # the engine's activations and caches (None: engine_dtype)
    expert_dtype: str = "dense"
    bucket_bytes: int = 1 << 20  # the model is ~3.6 MB in fp32: a few buckets per refit
    eval_prompts: int = 64
    timeout_s: float = 120.0


# ---------------------------------------------------------------------------------------------------
# the rollout engine: its own process, commands over a pipe
# ---------------------------------------------------------------------------------------------------
def rollout_worker(conn, engine_dtype: str, activation_dtype: str | None, expert_dtype: str, max_num_seqs: int) -> None:
    """The engine process: answers ("init", kwargs) | ("update", meta) | ("generate", prompts, params)
    | ("stop",) with ("ok", result) or ("error", message)."""
    torch.set_num_threads(1)
    from dsv4 import LLM, SamplingParams

    llm = LLM(BF16_MODEL, dtype=engine_dtype, activation_dtype=activation_dtype, expert_dtype=expert_dtype,
              max_num_seqs=max_num_seqs, max_model_len=task.MAX_SEQ_LEN + 1)
    while True:
        command, *args = conn.recv()
        if command == "stop":
            return
        try:
            if command == "init":
                result = llm.init_weight_transfer(**args[0])
            elif command == "update":
                result = llm.update_weights_from_distributed(args[0])
            else:  # generate
                outputs = llm.generate(args[0], SamplingParams(**args[1]), use_tqdm=False)
                result = [
                    {"weights_version": o.weights_version,
                     "completions": [(c.token_ids, [lp[t] for lp, t in zip(c.logprobs or [], c.token_ids)])
                                     for c in o.outputs]}
                    for o in outputs
                ]
            conn.send(("ok", result))
        except Exception as exc:  # reported to the trainer, which stops the run
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class RolloutEngine:
    """The trainer's handle on the engine process (started on enter, stopped and reaped on exit)."""

    def __init__(self, cfg: GRPOConfig):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.timeout = cfg.timeout_s
        self.process = context.Process(
            target=rollout_worker,
            args=(child, cfg.engine_dtype, cfg.activation_dtype, cfg.expert_dtype, cfg.prompts * cfg.group),
            daemon=True,
        )

    def __enter__(self) -> RolloutEngine:
        self.process.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.process.is_alive():
                self.conn.send(("stop",))
                self.process.join(timeout=10)
        finally:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(timeout=10)

    def submit(self, *command) -> None:
        self.conn.send(command)

    def result(self):
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"the rollout engine did not answer within {self.timeout} s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"rollout engine: {payload}")
        return payload

    def call(self, *command):
        self.submit(*command)
        return self.result()


def refit(engine: RolloutEngine, sender: WeightSender, model, cfg: GRPOConfig, version: int) -> dict:
    """Plan, hand the metadata to the engine, broadcast; both ends finish together."""
    tensors = model.state_dict()
    meta = sender.plan(tensors, bucket_bytes=cfg.bucket_bytes, base_version=version)
    engine.submit("update", meta)
    sent = sender.send(tensors, meta)
    received = engine.result()
    assert received["version"] == sent["versions"][ENGINE_RANK] == version + 1
    return {"version": received["version"], "send_s": sent["seconds"], "engine_update_s": received["seconds"],
            "bytes": sent["bytes"], "buckets": sent["buckets"]}


# ---------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------
def weakened_trainer(cfg: GRPOConfig):
    """The embedded bf16 model in transformers, fp32, every matrix perturbed by seeded relative noise."""
    from transformers import DeepseekV4ForCausalLM

    path, _ = resolve_model(BF16_MODEL, "auto")
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    noise = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.add_(torch.randn(param.shape, generator=noise) * cfg.weaken * param.std())
    return model


# Trainer parameters an engine keeps in fp32 whatever its dtype (the mHC mixing and the compressors' position
# biases; vectors are fp32 too): every other matrix is held in the engine's dtype.
ENGINE_FP32_MATRICES = ("_hc.", "hc_head.", "position_bias")


def resident_trainer(model, engine_dtype: str):
    """A frozen copy of the trainer holding the weights exactly as an engine of `engine_dtype` keeps them at
    rest (each matrix rounded to that dtype, then back to fp32): the trainer side of the "resident" agreement,
    which leaves out the weight rounding and so measures only what the engine computes differently."""
    resident = copy.deepcopy(model).requires_grad_(False)
    dtype = getattr(torch, engine_dtype)
    with torch.no_grad():
        for name, param in resident.named_parameters():
            if param.dim() >= 2 and not any(part in name for part in ENGINE_FP32_MATRICES):
                param.copy_(param.to(dtype))
    return resident


def completion_text(token_ids: list[int]) -> str:
    return "".join(task.VOCAB[t] for t in token_ids if t >= len(task.SPECIALS))


def reward(prompt: str, token_ids: list[int]) -> float:
    """1 for the exact sorted digits followed by end of sequence, else 0."""
    return float(token_ids[-1:] == [task.EOS_ID] and task.is_correct(prompt, completion_text(token_ids)))


def trainer_logprobs(model, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """Per sequence, the trainer's logprob of every token after its prompt (differentiable).

    Sequences of equal length run as one batch, with no padding: transformers' DeepseekV4 forward over a
    right-padded batch does not always reproduce the unpadded one at late positions (seen in this loop: a
    token at 0.986 alone, 0.997 beside a longer sequence), which would count against agreement although
    neither engine nor trainer is wrong about the sequence itself."""
    out: list[torch.Tensor | None] = [None] * len(sequences)
    by_length: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        by_length.setdefault(len(seq), []).append(i)
    for rows in by_length.values():
        ids = torch.tensor([sequences[i] for i in rows])
        logprobs = model(ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        for row, i in zip(logprobs, rows):
            out[i] = row[starts[i] - 1 :]  # row t predicts token t + 1: the response starts at its prompt's end
    return out  # type: ignore[return-value]


def held_out_accuracy(engine: RolloutEngine, n: int) -> float:
    examples = task.examples(n, seed=EVAL_SEED)
    prompts = [[task.BOS_ID, *task.encode(e.prompt)] for e in examples]
    outs = engine.call("generate", prompts, {"temperature": 0.0, "max_tokens": task.MAX_DIGITS + 1})
    return sum(reward(e.prompt, o["completions"][0][0]) for e, o in zip(examples, outs)) / n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cfg: GRPOConfig) -> dict:
    """The whole run; returns the results (also what `main` writes as JSON)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    rng = random.Random(cfg.seed)
    model = weakened_trainer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    port = free_port()
    log, refits = [], []
    start = time.perf_counter()
    with RolloutEngine(cfg) as engine:
        engine.submit("init", {"master_address": "127.0.0.1", "master_port": port, "rank_offset": ENGINE_RANK,
                               "world_size": WORLD_SIZE, "timeout": cfg.timeout_s})
        sender = WeightSender("127.0.0.1", port, WORLD_SIZE, timeout=cfg.timeout_s)
        engine.result()
        refits.append(refit(engine, sender, model, cfg, version=0))  # the weakened weights replace the shipped ones
        accuracy_before = held_out_accuracy(engine, cfg.eval_prompts)
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            examples = [task.sample(rng) for _ in range(cfg.prompts)]
            prompts = [[task.BOS_ID, *task.encode(e.prompt)] for e in examples]
            params = {"n": cfg.group, "temperature": 1.0, "max_tokens": task.MAX_DIGITS + 1, "logprobs": 0,
                      "seed": cfg.seed * 1_000_000 + step}
            outs = engine.call("generate", prompts, params)
            t1 = time.perf_counter()
            sequences, starts, rollout_lp, rewards = [], [], [], []
            for example, prompt, out in zip(examples, prompts, outs):
                assert out["weights_version"] == refits[-1]["version"]  # sampled by the weights just sent
                for tokens, logprobs in out["completions"]:
                    sequences.append(prompt + tokens)
                    starts.append(len(prompt))
                    rollout_lp.append(logprobs)
                    rewards.append(reward(example.prompt, tokens))
            r = torch.tensor(rewards).view(cfg.prompts, cfg.group)
            advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + ADVANTAGE_EPS)).view(-1)
            logprobs = trainer_logprobs(model, sequences, starts)
            metrics = agreement(rollout_lp, [lp.detach() for lp in logprobs])
            resident = {}
            if cfg.engine_dtype != "float32" and cfg.expert_dtype == "dense":  # the engine rounds the weights
                with torch.no_grad():
                    rounded = trainer_logprobs(resident_trainer(model, cfg.engine_dtype), sequences, starts)
                resident = {f"resident_{k}": v for k, v in agreement(rollout_lp, rounded).as_dict().items()
                            if k != "tokens"}
            loss = -torch.stack([a * lp.mean() for a, lp in zip(advantages, logprobs)]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            t2 = time.perf_counter()
            refits.append(refit(engine, sender, model, cfg, version=refits[-1]["version"]))
            entry = {"step": step, "reward": r.mean().item(), **metrics.as_dict(), **resident, "loss": loss.item(),
                     "rollout_s": t1 - t0, "train_s": t2 - t1, **{f"refit_{k}": v for k, v in refits[-1].items()}}
            log.append(entry)
            print(json.dumps({k: round(v, 8) if isinstance(v, float) else v for k, v in entry.items()}), flush=True)
        accuracy_after = held_out_accuracy(engine, cfg.eval_prompts)
    first = sum(e["reward"] for e in log[:FIRST_STEPS]) / max(1, len(log[:FIRST_STEPS]))
    last = sum(e["reward"] for e in log[-LAST_STEPS:]) / max(1, len(log[-LAST_STEPS:]))
    summary = {
        "reward_first_steps": first, "reward_last_steps": last, "reward_rise": last - first,
        "learned": last - first >= REWARD_RISE and accuracy_after > accuracy_before,
        "held_out_accuracy_before": accuracy_before, "held_out_accuracy_after": accuracy_after,
        "refits": len(refits), "weights_version": refits[-1]["version"],
        "max_rollout_probs_diff_mean": max(e["rollout_probs_diff_mean"] for e in log) if log else None,
        "min_pearson": min(e["rollout_actor_probs_pearson_corr"] for e in log) if log else None,
        "max_k3_kl": max(e["k3_kl"] for e in log) if log else None,
        "max_resident_rollout_probs_diff_mean": max((e["resident_rollout_probs_diff_mean"] for e in log
                                                     if "resident_k3_kl" in e), default=None),
        "min_resident_pearson": min((e["resident_rollout_actor_probs_pearson_corr"] for e in log
                                     if "resident_k3_kl" in e), default=None),
        "mean_refit_send_s": sum(r["send_s"] for r in refits) / len(refits),
        "seconds": time.perf_counter() - start,
    }
    return {"config": asdict(cfg), "summary": summary, "steps": log, "refits": refits,
            "torch": torch.__version__, "timing_note": "contended 2-core CPU VM unless stated otherwise"}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in results["steps"]]
    cfg = results["config"]
    fig, (ax_r, ax_d, ax_p) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax_r.plot(steps, [e["reward"] for e in results["steps"]], marker=".")
    ax_r.set_ylabel("mean reward")
    activations = f" ({cfg['activation_dtype']} activations)" if cfg.get("activation_dtype") else ""
    ax_r.set_title(f"GRPO on sort_digits: {cfg['engine_dtype']} engine{activations}, {cfg['expert_dtype']} "
                   f"experts,\nrefit over gloo every step")
    entries = results["steps"]
    ax_d.semilogy(steps, [max(e["rollout_probs_diff_mean"], 1e-12) for e in entries], marker=".",
                  label="rollout_probs_diff_mean")
    ax_d.semilogy(steps, [max(e["rollout_probs_diff_max"], 1e-12) for e in entries], marker=".",
                  label="rollout_probs_diff_max")
    ax_p.plot(steps, [max(1 - e["rollout_actor_probs_pearson_corr"], 1e-16) for e in entries], marker=".",
              label="vs the fp32 trainer")
    if "resident_k3_kl" in entries[0]:
        ax_d.semilogy(steps, [max(e["resident_rollout_probs_diff_mean"], 1e-12) for e in entries],
                      marker=".", label="diff_mean vs the trainer on the engine's rounded weights")
        ax_p.plot(steps, [max(1 - e["resident_rollout_actor_probs_pearson_corr"], 1e-16) for e in entries],
                  marker=".", label="vs the trainer on the engine's rounded weights")
        ax_p.legend(fontsize="small")
    ax_d.legend(fontsize="small")
    ax_d.set_ylabel("|p_rollout - p_trainer|")
    ax_p.set_yscale("log")
    ax_p.set_ylabel("1 - pearson")
    ax_p.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def activation_tag(cfg: GRPOConfig) -> str:
    """The result files' name part for activations wider than the engine's weights ("_fp32act"), else ""."""
    if cfg.activation_dtype in (None, cfg.engine_dtype):
        return ""
    return "_" + {"float32": "fp32", "bfloat16": "bf16"}[cfg.activation_dtype] + "act"


def main(argv: list[str] | None = None) -> dict:
    defaults = GRPOConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for field, value in asdict(defaults).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=str if value is None else type(value), default=value)
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and the plot")
    p.add_argument("--no-plot", action="store_true")
    args = vars(p.parse_args(argv))
    out, no_plot = args.pop("out"), args.pop("no_plot")
    cfg = GRPOConfig(**args)
    results = run(cfg)
    out.mkdir(parents=True, exist_ok=True)
    name = f"grpo_sort_{cfg.engine_dtype}{activation_tag(cfg)}_{cfg.expert_dtype}"
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    if not no_plot:
        plot(results, out / f"{name}.png")
    print(json.dumps(results["summary"], indent=1))
    return results


if __name__ == "__main__":
    main()
