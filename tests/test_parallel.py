"""Tensor and expert parallelism (`LLM(tensor_parallel_size=2, expert_parallel=...)`) against one process.

Two ranks are spawned (torch.multiprocessing, gloo on a free loopback port, fp32) and run the same
program, SPMD as under torchrun; each writes what it generated to a file the test reads. The checks:

* greedy output ids equal one process's and logprobs within LOGPROB_TOL, on the tiny config (sliding,
  compressed-sparse with indexer and heavily-compressed layers; hash-routed and top-k MoE), for TP with
  and without expert parallelism, from a sharded native fp32 checkpoint, an HF-names checkpoint (stacked
  experts), the release format (FP8 dense linears + FP4 experts, resident FP4 with their width split, and
  split by expert), and with MTP speculation on;
* every rank returns the same results, and the merged weight report shows no replicated tensor that
  differs between ranks and the full shapes;
* the model each rank builds matches the sharding plan, and a refit per rank (full tensors in: native,
  HF stacked, FP8/FP4) ends bit-equal to a fresh load of the rank's shard, with no address moved;
* a group that cannot form, a wrong world size, and a rank that dies give a clear error, not a hang;
* weight sync from a trainer process (`weight_trainer.Trainer`, rank 0 of a transfer group of 1 + 2) to
  both ranks, drafter included (TP from fp32 tensors; EP from release-format FP8 / FP4 bytes and scales):
  every rank receives the full tensors and keeps its shard, ends bit-equal to a fresh load of the new
  checkpoint's shard with no address moved and its version bumped, and generates what one process loaded
  from the new checkpoint does; a trainer dying mid-transfer (TP), a malformed tensor of an expert only one
  rank holds and a full update without that expert (EP) fail every rank fast and clearly, with the old
  weights serving on all of them (atomic, across ranks); then a new group (TP) or the same group (EP)
  carries the update.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

import parallel_ranks as ranks
import reference as ref
from dsv4 import LLM
from dsv4.errors import CheckpointError, ConfigError, ParallelError
from dsv4.parallel.plan import split_of
from dsv4.parallel.state import ParallelState
from dsv4.weights.loader import build_models, load_models
from dsv4.weights.refit import WeightUpdateSession
from dsv4.weights.report import weight_report
from dsv4.weights.slots import SlotTable
from parallel_ranks import ENGINE, WORLD, free_port, results
from weight_trainer import DIE_EXIT_CODE, QUEUE_WAIT_S, Trainer

TIMEOUT_S = 20.0  # any collective of the spawned ranks; generous for 2 shared cores, far below a hang
SHORT_TIMEOUT_S = 2.0  # the group that cannot form, and the group that loses a rank
LOGPROB_TOL = 1e-5
SEED = 4242
# Launches of the exit test (its abort came in most runs, not all) and how much later its rank 1 leaves.
EXIT_LAUNCHES = 3
EXIT_STAGGER_S = 0.2
NEW_SEED, NEW_MTP_SEED = 4343, 4344  # the weights a trainer sends
SYNC_TIMEOUT_S = 10.0  # any single wait of the weight sync (transfer group, hand-over queues)
SYNC_BUCKET_BYTES = 64 << 10  # many buckets for the tiny model
DIE_AT_BUCKET = 3
MTP = {"draft": "mtp", "num_speculative_tokens": 2}
# Scenario -> (checkpoint fixture key, LLM options).
SCENARIOS = {
    "native_tp": ("native", {}),
    "native_ep": ("native", {"expert_parallel": True}),
    "hf_tp": ("hf", {}),
    "hf_ep": ("hf", {"expert_parallel": True}),
    "release_ep": ("release", {"expert_parallel": True}),
    "release_wide_tp": ("release_wide", {}),  # resident FP4 experts, width split on scale groups
    "mtp_ep": ("mtp", {"expert_parallel": True, "draft": "mtp", "num_speculative_tokens": 2}),
}


# ---- checkpoints ----
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel")
    config = ref.tiny_config()
    native = ref.native_state_dict(ref.build_reference_model(config, SEED))
    paths = {key: root / key for key in ("native", "hf", "release", "release_wide", "mtp")}
    ref.write_native_checkpoint(paths["native"], config, native, shards=3)
    paths["hf"].mkdir()
    (paths["hf"] / "config.json").write_text(json.dumps(config))
    hf = ref.hf_state_from_native(native, config)
    save_file({n: t.contiguous() for n, t in hf.items()}, str(paths["hf"] / "model.safetensors"))
    ref.write_native_checkpoint(paths["release"], config, native, dense="fp8", expert_dtype="fp4")
    wide = ref.tiny_config(moe_intermediate_size=64)  # 32 per rank: whole FP4 scale groups
    wide_native = ref.native_state_dict(ref.build_reference_model(wide, SEED))
    ref.write_native_checkpoint(paths["release_wide"], wide, wide_native, dense="fp8", expert_dtype="fp4")
    with_mtp = {**native, **ref.random_mtp_tensors(config, SEED)}
    ref.write_native_checkpoint(paths["mtp"], config, with_mtp)
    return paths


def _spawn(fn, args: tuple, nprocs: int = WORLD) -> None:
    mp.spawn(fn, args=args, nprocs=nprocs, join=True)


# ---- generation: 2 ranks against one process ----
@pytest.fixture(scope="module")
def spawned(checkpoints, tmp_path_factory) -> Path:
    """One launch of two ranks for every scenario, ending with a rank that dies (`parallel_ranks`)."""
    out = tmp_path_factory.mktemp("ranks")
    scenarios = {key: (str(checkpoints[ckpt]), options) for key, (ckpt, options) in SCENARIOS.items()}
    _spawn(ranks.scenario_rank, (free_port(), str(out), scenarios, TIMEOUT_S, str(checkpoints["native"]),
                                 SHORT_TIMEOUT_S))
    return out


@pytest.fixture(scope="module")
def rank_results(spawned) -> list[dict]:
    return [torch.load(spawned / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def one_process(checkpoints) -> dict[str, dict]:
    """One process's results per checkpoint (MTP: plain decoding, which greedy speculation must equal)."""
    return {key: results(LLM(checkpoints[key], **ENGINE)) for key in ("native", "release", "release_wide", "mtp")}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_two_ranks_generate_what_one_process_does(rank_results, one_process, scenario):
    ckpt = SCENARIOS[scenario][0]
    expected = one_process["native" if ckpt == "hf" else ckpt]
    for rank, found in enumerate(rank_results):
        got = found[scenario]
        assert got["ids"] == expected["ids"], f"rank {rank}"
        for lp, want in zip(got["logprobs"], expected["logprobs"], strict=True):
            assert lp.shape == want.shape
            assert (lp - want).abs().max().item() <= LOGPROB_TOL, f"rank {rank}"
    # Every rank sampled from the same gathered logits: bit-identical results, not merely close ones.
    for key in SCENARIOS:
        assert rank_results[0][key]["ids"] == rank_results[1][key]["ids"]
        assert rank_results[0][key]["sampled"] == rank_results[1][key]["sampled"]
        first, second = (rank_results[r][key]["logprobs"] for r in range(WORLD))
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_merged_weight_report_has_full_shapes_and_agreeing_replicas(rank_results, checkpoints):
    merged = rank_results[0]["merged_report"]
    assert merged == rank_results[1]["merged_report"]
    assert merged["ready"] and merged["world_size"] == WORLD and merged["disagreeing"] == []
    single = weight_report(load_models(checkpoints["native"]), 0)["tensors"]
    assert set(merged["tensors"]) == set(single)
    for name, entry in merged["tensors"].items():
        assert entry["shape"] == single[name]["shape"], name
        if entry["split_dim"] is None and not name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            assert entry["ranks"] == list(range(WORLD)) and set(entry["checksums"]) == {single[name]["checksum"]}
    # Expert parallel: each rank holds half the experts, so a stacked parameter's dim 0 is split.
    assert merged["tensors"]["layers.0.ffn.experts.w1"]["split_dim"] == 0
    assert merged["tensors"]["layers.0.attn.wq_b.weight"]["split_dim"] == 0


# ---- what each rank builds and loads (no collectives needed: in this process, rank by rank) ----
def _states(expert_parallel: bool) -> list[ParallelState]:
    return [ParallelState(rank=r, world_size=WORLD, expert_parallel=expert_parallel) for r in range(WORLD)]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_builds_its_shard_of_the_plan(checkpoints, expert_parallel):
    from dsv4.config import ModelConfig

    cfg = ModelConfig.from_file(checkpoints["native"])
    full = {s.native: s.logical for s in SlotTable(build_models(cfg, "dense", torch.float32, "cpu", "mtp"))}
    held: set[str] = set()
    for state in _states(expert_parallel):
        for slot in SlotTable(build_models(cfg, "dense", torch.float32, "cpu", "mtp", parallel=state)):
            split = split_of(slot.native, state)
            want = list(full[slot.native])
            if split is not None:
                want[split.dim] //= WORLD
            assert list(slot.logical) == want, slot.native
            held.add(slot.native)
    assert held == set(full)  # every expert on some rank


def _checksums(loaded) -> dict[str, tuple[str, int]]:
    return {k: (v["checksum"], v["data_ptr"]) for k, v in weight_report(loaded, 0)["tensors"].items()}


@pytest.mark.parametrize(("ckpt", "expert_parallel", "source"), [
    ("native", False, "native"), ("native", True, "hf"), ("release", True, "native"), ("release_wide", False, "native"),
    ("mtp", False, "native"), ("mtp", True, "native"),  # the MTP drafter refits in the same session
])
def test_a_refit_per_rank_equals_a_fresh_load_of_its_shard(checkpoints, ckpt, expert_parallel, source):
    path = checkpoints[ckpt]
    draft = "mtp" if ckpt == "mtp" else None
    tensors = ref.read_safetensors_dir(path)
    if source == "hf":
        tensors = ref.hf_state_from_native(tensors, ref.tiny_config())
    for state in _states(expert_parallel):
        fresh = _checksums(load_models(path, parallel=state, draft=draft))
        dummy = load_models(path, load_format="dummy", parallel=state, draft=draft)
        before = {k: ptr for k, (_, ptr) in _checksums(dummy).items()}
        assert {k: c for k, (c, _) in _checksums(dummy).items()} != {k: c for k, (c, _) in fresh.items()}
        # Two buckets, the scales first where there are any: the slicer pairs halves across buckets.
        names = sorted(tensors, key=lambda n: not n.endswith(".scale"))
        # ranks simulated in one process: no group to agree with (the spawned tests cover agreement)
        with WeightUpdateSession(dummy, 0, lambda: 1, atomic=True, full=True, rank_agreement=False) as session:
            for bucket in (names[: len(names) // 2], names[len(names) // 2 :]):
                session.load([(n, tensors[n]) for n in bucket])
        after = _checksums(dummy)
        assert {k: c for k, (c, _) in after.items()} == {k: c for k, (c, _) in fresh.items()}, f"rank {state.rank}"
        assert {k: ptr for k, (_, ptr) in after.items()} == before


def test_a_wrong_full_shape_fails_on_every_rank(checkpoints, tmp_path):
    tensors = ref.read_safetensors_dir(checkpoints["native"])
    tensors["layers.1.attn.wq_b.weight"] = tensors["layers.1.attn.wq_b.weight"][:96]  # 3 heads' rows of 4
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoints["native"] / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(broken / "model.safetensors"))
    for state in _states(False):  # rank 0's 64 rows would fit; the full size is what is checked
        with pytest.raises(CheckpointError, match=r"wq_b.*expected 128 along dim 0"):
            load_models(broken, parallel=state)


def test_indivisible_configs_are_refused_naming_the_field(checkpoints):
    from dsv4.config import ModelConfig

    cfg = ModelConfig.from_file(checkpoints["release"])
    with pytest.raises(ConfigError, match=r"'moe_intermediate_size'.*FP4 scale group 32"):
        build_models(cfg, "fp4", torch.float32, "cpu", None, parallel=_states(False)[0])
    three = ParallelState(rank=0, world_size=3)
    with pytest.raises(ConfigError, match=r"'vocab_size': 512 is not divisible by 3"):
        build_models(cfg, "dense", torch.float32, "cpu", None, parallel=three)


# ---- groups that cannot form, ranks that die ----
def test_a_launch_without_a_group_is_refused(checkpoints, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        LLM(checkpoints["native"], tensor_parallel_size=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ConfigError, match="WORLD_SIZE=3"):
        LLM(checkpoints["native"], tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="compile=True"):
        LLM(checkpoints["native"], tensor_parallel_size=2, compile=True)


def test_a_rank_that_never_arrives_times_out_clearly(checkpoints, tmp_path):
    _spawn(ranks.lonely_rank, (free_port(), str(tmp_path), str(checkpoints["native"]), SHORT_TIMEOUT_S), nprocs=1)
    seconds, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert message.startswith(ParallelError.__name__), message
    assert "2 ranks" in message and f"{SHORT_TIMEOUT_S:g} s timeout" in message
    assert float(seconds) < SHORT_TIMEOUT_S + 10


def test_a_rank_that_dies_fails_the_others_clearly(spawned):
    seconds, message = (spawned / "rank0.txt").read_text().split("\n", 1)
    assert message.startswith(ParallelError.__name__), message
    assert "rank 0 of 2" in message and f"{SHORT_TIMEOUT_S:g} s timeout" in message
    assert float(seconds) < SHORT_TIMEOUT_S + 10


def test_a_rank_reads_no_byte_of_other_ranks_experts(checkpoints, monkeypatch):
    from dsv4.weights.checkpoint import CheckpointDir

    read: list[str] = []
    original = CheckpointDir.iter_tensors

    def recording(self, wanted=lambda name: True, *args):
        for name, tensor, origin in original(self, wanted, *args):
            read.append(name)
            yield name, tensor, origin

    monkeypatch.setattr(CheckpointDir, "iter_tensors", recording)
    for state in _states(True):
        read.clear()
        loaded = load_models(checkpoints["native"], parallel=state)
        first, stop = state.expert_range(loaded.config.n_routed_experts)
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
        assert experts == set(range(first, stop)), f"rank {state.rank}"


# ---- weight sync from a trainer process to every rank ----
# Case -> (stored format: write_native_checkpoint options, LLM options, what goes wrong before the good update:
# "dies": a trainer dies mid-transfer; "one_rank_rejects": a tensor only one rank holds is malformed, then
# missing from a full update).
SYNC_CASES = {
    "tp_fp32": ({}, {}, "dies"),
    "ep_release": ({"dense": "fp8", "expert_dtype": "fp4"}, {"expert_parallel": True}, "one_rank_rejects"),
}
ONE_RANKS_EXPERT = "layers.0.ffn.experts.0.w1.weight"  # expert parallel: only rank 0 holds expert 0


@pytest.fixture(scope="module")
def sync_checkpoints(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per case: the engines' "old" checkpoint, the "new" one a trainer sends, and exactly its stored tensors
    ("new_tensors", native names: FP8 / FP4 bytes with their scales in the release format), drafter included."""
    root = tmp_path_factory.mktemp("sync")
    config = ref.tiny_config()
    old = ref.native_state_dict(ref.build_reference_model(config, SEED)) | ref.random_mtp_tensors(config, SEED)
    new = ref.native_state_dict(ref.build_reference_model(config, NEW_SEED))
    new |= ref.random_mtp_tensors(config, NEW_MTP_SEED)
    paths = {}
    for case, (stored_as, _, _) in SYNC_CASES.items():
        paths[case] = {"old": root / case / "old", "new": root / case / "new",
                       "new_tensors": root / case / "new.safetensors"}
        ref.write_native_checkpoint(paths[case]["old"], config, old, **stored_as)
        stored = ref.write_native_checkpoint(paths[case]["new"], config, new, **stored_as)
        save_file({n: t.contiguous() for n, t in stored.items()}, str(paths[case]["new_tensors"]))
    return paths


@pytest.fixture(scope="module")
def sync_one_process(sync_checkpoints) -> dict[str, dict[str, dict]]:
    """One process's results on each case's old and new checkpoint (plain decoding)."""
    return {case: {key: results(LLM(paths[key], **ENGINE)) for key in ("old", "new")}
            for case, paths in sync_checkpoints.items()}


def _next_from_ranks(outbox, launched) -> object:
    """The ranks' next message; a rank that failed raises here instead of being waited for."""
    deadline = time.monotonic() + QUEUE_WAIT_S
    while time.monotonic() < deadline:
        launched.join(timeout=0)
        try:
            return outbox.get(timeout=1.0)
        except queue.Empty:
            continue
    raise AssertionError(f"the ranks sent nothing within {QUEUE_WAIT_S} s")


def _sync(old: Path, new_tensors: Path, options: dict, trainers: list[list[dict]], out: Path) -> tuple[list, list]:
    """Two engine ranks loaded from `old` join one trainer process after another, each sending `new_tensors`
    in its steps (`trainers`; a step's "full" goes to the engines' update); returns each rank's record
    (`parallel_ranks.weight_sync_rank`) and what the trainers said of each step ("sent", their "error", or
    the exit code of one that died)."""
    context = mp.get_context("spawn")
    inboxes, outbox = [context.Queue() for _ in range(WORLD)], context.Queue()
    launched = mp.start_processes(
        ranks.weight_sync_rank, nprocs=WORLD, join=False, start_method="spawn",
        args=(free_port(), str(out), str(old), {**options, **MTP}, SYNC_TIMEOUT_S, inboxes, outbox),
    )

    def to_ranks(kind: str, payload: object) -> None:
        for box in inboxes:
            box.put((kind, payload))

    said = []
    try:
        for _ in range(WORLD):  # loaded: a trainer's join timeout starts only now
            assert _next_from_ranks(outbox, launched)[0] == "ready"
        for steps in trainers:
            with Trainer(new_tensors, steps, world_size=1 + WORLD, timeout=SYNC_TIMEOUT_S) as trainer:
                to_ranks("join", trainer.port)
                trainer.next("joined")
                for step in steps:
                    to_ranks("update", (trainer.next("meta"), {"full": step.get("full", False)}))
                    if step.get("die_at_bucket") is not None:
                        trainer.process.join(timeout=QUEUE_WAIT_S)
                        said.append(trainer.process.exitcode)
                    else:
                        fails = step.get("unknown_tensor") or step.get("omit_prefix")
                        said.append(trainer.next("error" if fails else "sent"))
        to_ranks("end", None)
        deadline = time.monotonic() + QUEUE_WAIT_S
        while not launched.join(timeout=1.0):
            assert time.monotonic() < deadline, "the ranks did not finish"
    except AssertionError:
        launched.join(timeout=5.0)  # a rank that raised is the cause: its error, rather than our waiting's
        raise
    finally:
        for process in launched.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)], said


def _assert_generates(found: dict, expected: dict, rank: int) -> None:
    assert found["ids"] == expected["ids"], f"rank {rank}"
    for lp, want in zip(found["logprobs"], expected["logprobs"], strict=True):
        assert (lp - want).abs().max().item() <= LOGPROB_TOL, f"rank {rank}"


@pytest.mark.parametrize("case", sorted(SYNC_CASES))
def test_weight_sync_from_a_trainer_reaches_every_rank_drafter_included(
    sync_checkpoints, sync_one_process, tmp_path, case
):
    paths, expected = sync_checkpoints[case], sync_one_process[case]
    _, options, first = SYNC_CASES[case]
    good = {"base_version": 0, "bucket_bytes": SYNC_BUCKET_BYTES}
    if first == "dies":  # then a new trainer, a new group (one launch of the ranks for both: they start slowly)
        trainers = [[{**good, "die_at_bucket": DIE_AT_BUCKET}], [good]]
    else:  # then the same group carries the good update
        trainers = [[{**good, "unknown_tensor": ONE_RANKS_EXPERT},
                     {**good, "omit_prefix": ONE_RANKS_EXPERT.removesuffix("weight"), "full": True}, good]]
    # Per failed update: the error type, and the text every rank's message holds.
    failures = {"dies": [("WeightTransferError", "receiving bucket")],
                "one_rank_rejects": [("WeightUpdateError", ONE_RANKS_EXPERT), ("WeightUpdateError", "missing tensor")]}
    found, said = _sync(paths["old"], paths["new_tensors"], options, trainers, tmp_path)
    assert said[-1]["versions"] == {1 + r: 1 for r in range(WORLD)} and said[-1]["buckets"] > DIE_AT_BUCKET + 1
    if first == "dies":
        assert said[0] == DIE_EXIT_CODE
    else:  # the trainer hears both engine ranks' reasons
        for (kind, message), (_, text) in zip(said[:-1], failures[first], strict=True):
            assert kind == "WeightUpdateError" and text in message
            assert "engine rank 2: " in message and "engine rank 1 failed to stage it" in message, message
    for state, rank_found in zip(_states(options.get("expert_parallel", False)), found, strict=True):
        rank, before = state.rank, rank_found["before"]
        # What went wrong: a clear error on every rank, fast, and the old weights still serve everywhere.
        for failed, (kind, text) in zip(rank_found["updates"][:-1], failures[first], strict=True):
            assert failed["outcome"].startswith(kind) and text in failed["outcome"], failed["outcome"]
            if first == "one_rank_rejects":  # rank 0 failed; rank 1, which drops expert 0, did not commit either
                assert ("failed to stage it" in failed["outcome"]) == (rank == 1), failed["outcome"]
            assert failed["seconds"] < SYNC_TIMEOUT_S, f"rank {rank} waited the timeout out"
            assert failed["version"] == 0 and failed["ready"], f"rank {rank}"
            assert failed["checksums"] == before["checksums"] and failed["pointers"] == before["pointers"]
            _assert_generates(failed["results"], expected["old"], rank)
        # The good update lands on every rank.
        fresh = {k: c for k, (c, _) in _checksums(load_models(paths["new"], parallel=state, draft="mtp")).items()}
        synced = rank_found["updates"][-1]
        assert synced["outcome"] == 1 == synced["version"] and synced["ready"], f"rank {rank}"
        assert synced["checksums"] == fresh, f"rank {rank}"
        changed = {k for k in fresh if fresh[k] != before["checksums"][k]}
        assert any(k.startswith("mtp:") for k in changed) and any(not k.startswith("mtp:") for k in changed)
        assert synced["pointers"] == before["pointers"], f"rank {rank}"
        _assert_generates(synced["results"], expected["new"], rank)
    # Every rank sampled from the same gathered logits, after each update or failed one.
    for first_rank, second_rank in zip(found[0]["updates"], found[1]["updates"], strict=True):
        assert first_rank["results"]["sampled"] == second_rank["results"]["sampled"]


# ---- in-process updates: the ranks agree before any commits ----
def test_in_process_updates_commit_on_every_rank_or_on_none(checkpoints, tmp_path):
    """SPMD in-process updates under expert parallelism: a malformed tensor of an expert only rank 0 holds
    (rank 1 drops it unread) fails on both ranks with the old weights serving on both; the good update lands
    on both; an update of that one expert (nothing for rank 1) bumps both ranks' version."""
    new_path = tmp_path / "new"
    config = ref.tiny_config()
    ref.write_native_checkpoint(new_path, config, ref.native_state_dict(ref.build_reference_model(config, NEW_SEED)))
    new = ref.read_safetensors_dir(new_path)
    _spawn(ranks.in_process_update_rank, (free_port(), str(tmp_path), str(checkpoints["native"]), new,
                                          ONE_RANKS_EXPERT, TIMEOUT_S))
    found = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    fresh = [{k: c for k, (c, _) in _checksums(load_models(new_path, parallel=s)).items()}
             for s in _states(True)]
    for rank, f in enumerate(found):
        assert f["before"]["version"] == 0
        assert f["bad"]["error"] is not None and f["bad"]["version"] == 0, f"rank {rank}"
        assert f["bad"]["checksums"] == f["before"]["checksums"], f"rank {rank}: a half-applied update serves"
        assert "tensor parallel rank 0 failed the update" in f["bad"]["error"] if rank == 1 else \
            ONE_RANKS_EXPERT in f["bad"]["error"]
        assert f["good"]["error"] is None and f["good"]["version"] == 1
        assert f["good"]["checksums"] == fresh[rank], f"rank {rank}"
        assert f["one_expert"]["error"] is None and f["one_expert"]["version"] == 2, f"rank {rank}"


def test_ranks_that_leave_at_different_times_exit_cleanly(checkpoints):
    """A rank that exits while another is still running must not take it down: the engine leaves the process
    group it formed at exit. (Before, the later rank's gloo threads saw the first one's sockets close and
    aborted the process with SIGABRT, in most runs on a fast machine.)"""
    for _ in range(EXIT_LAUNCHES):
        _spawn(ranks.exit_rank, (free_port(), str(checkpoints["native"]), EXIT_STAGGER_S))

