"""Weight sync from a trainer in another process over torch.distributed (gloo, loopback), and from a
colocated trainer through shared memory: the update is a refit session end to end (equal to a fresh load,
drafter included, addresses unchanged, version bumped, requests in flight not continued on new weights),
refusals happen before a byte moves, failures leave nothing half-applied serving, and no wait is unbounded.

The trainer runs in a spawned process (`weight_trainer.run_trainer`); every queue read, join and process
wait has a timeout, and the process is killed in `finally`.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.errors import ConfigError, WeightsNotReadyError, WeightTransferError, WeightUpdateError
from dsv4.rl import ColocatedWeightSender
from weight_trainer import (
    DIE_EXIT_CODE,
    GROUP_TIMEOUT_S,
    QUEUE_WAIT_S,
    UNKNOWN_TENSOR,
    Trainer,
    free_port,
    wait_listening,
)

OLD_SEED, NEW_SEED, OLD_MTP_SEED, NEW_MTP_SEED = 1, 2, 11, 12
ENGINE = {"dtype": "float32", "max_num_seqs": 2, "max_model_len": 64, "draft": "mtp"}
SMALL_BUCKETS = 64 << 10  # many buckets for the tiny model (~0.5 MB of FP8/FP4 bytes)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]


@dataclass
class Checkpoints:
    old: Path
    new: Path
    new_tensors: Path  # exactly the stored tensors of `new` (native names, FP8 / FP4 + scales, mtp.*)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Checkpoints:
    root = tmp_path_factory.mktemp("transfer")
    cfg = ref.tiny_config()
    old = ref.native_state_dict(ref.build_reference_model(cfg, OLD_SEED)) | ref.random_mtp_tensors(cfg, OLD_MTP_SEED)
    new = ref.native_state_dict(ref.build_reference_model(cfg, NEW_SEED)) | ref.random_mtp_tensors(cfg, NEW_MTP_SEED)
    ref.write_native_checkpoint(root / "old", cfg, old, dense="fp8", expert_dtype="fp4")
    stored = ref.write_native_checkpoint(root / "new", cfg, new, dense="fp8", expert_dtype="fp4")
    save_file({n: t.contiguous() for n, t in stored.items()}, str(root / "new.safetensors"))
    return Checkpoints(root / "old", root / "new", root / "new.safetensors")


@pytest.fixture(scope="module")
def fresh_new(ckpts) -> dict:
    llm = LLM(ckpts.new, **ENGINE)
    return {"checksums": _checksums(llm), "logprobs": llm.forward_logprobs([PROMPT])[0]}


def _checksums(llm: LLM) -> dict[str, str]:
    return {name: t["checksum"] for name, t in llm.weight_report()["tensors"].items()}


def _pointers(llm: LLM) -> dict[str, int]:
    return {name: t["data_ptr"] for name, t in llm.weight_report()["tensors"].items()}


def _join(trainer: Trainer, engine: LLM, **kwargs) -> None:
    engine.init_weight_transfer("127.0.0.1", trainer.port, timeout=trainer.timeout, **kwargs)
    trainer.next("joined")


def _step(base_version: int | None = 0, **options) -> dict:
    return {"base_version": base_version, "bucket_bytes": SMALL_BUCKETS, **options}


# ---- success ----
def test_update_over_gloo_equals_a_fresh_load_drafter_included(ckpts, fresh_new):
    llm = LLM(ckpts.old, **ENGINE)
    built, before = _pointers(llm), _checksums(llm)
    stream = llm.stream([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))
    first = next(stream)  # a request in flight, its cache computed with the old weights
    with Trainer(ckpts.new_tensors, [_step()]) as trainer:
        _join(trainer, llm)
        result = llm.update_weights_from_distributed(trainer.next("meta"))
        sent = trainer.next("sent")
    assert result["version"] == 1 == llm.weights_version == sent["versions"][1]
    assert result["buckets"] == sent["buckets"] > 2 and result["bytes"] == sent["bytes"]
    after = _checksums(llm)
    assert after == fresh_new["checksums"]
    changed = {k for k in after if after[k] != before[k]}
    assert any(k.startswith("mtp:") for k in changed) and any(not k.startswith("mtp:") for k in changed)
    assert _pointers(llm) == built
    assert llm.weight_report()["ready"]
    torch.testing.assert_close(llm.forward_logprobs([PROMPT])[0], fresh_new["logprobs"], rtol=0, atol=0)
    # The request in flight was not continued on the new weights: it ended, under the old version.
    rest = list(stream)
    assert first.weights_version == 0 and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "abort" and rest[-1].weights_version == 0
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].weights_version == 1


# ---- refusals and failures on a live group ----
def test_refused_and_failed_updates_apply_nothing_and_keep_the_group(ckpts, fresh_new):
    llm = LLM(ckpts.old, **ENGINE)
    before = _checksums(llm)
    steps = [_step(base_version=5), _step(change_after_plan=True), _step(unknown_tensor=True), _step()]
    with Trainer(ckpts.new_tensors, steps) as trainer:
        _join(trainer, llm)
        meta = trainer.next("meta")
        # 0. a bad argument is refused here before the protocol starts: the trainer still waits for the plan's
        #    acceptance, which the next call gives
        with pytest.raises(ConfigError, match="pause"):
            llm.update_weights_from_distributed(meta, pause="sometimes")
        # 1. built for another weights version: refused on both ends before a byte moves
        with pytest.raises(WeightUpdateError, match=r"based on weights version 5.*holds version 0"):
            llm.update_weights_from_distributed(meta)
        kind, message = trainer.next("error")
        assert kind == "WeightUpdateError" and "refused it" in message and "version 5" in message
        # 2. a tensor changed between plan and send: the checksum catches it, nothing is applied
        with pytest.raises(WeightUpdateError, match="checksum"):
            llm.update_weights_from_distributed(trainer.next("meta"))
        kind, message = trainer.next("error")
        assert kind == "WeightUpdateError" and "checksum" in message
        # 3. a name the model does not have: the refit session rejects it, the trainer hears why
        with pytest.raises(WeightUpdateError, match="unexpected tensor"):
            llm.update_weights_from_distributed(trainer.next("meta"))
        assert UNKNOWN_TENSOR in trainer.next("error")[1]
        assert _checksums(llm) == before and llm.weights_version == 0 and llm.weight_report()["ready"]
        # 4. the same group then carries a good update
        assert llm.update_weights_from_distributed(trainer.next("meta"))["version"] == 1
        assert trainer.next("sent")["versions"] == {1: 1}
    assert _checksums(llm) == fresh_new["checksums"]


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "fail_stop"])
def test_a_trainer_dying_mid_transfer_fails_fast_and_nothing_half_applied_serves(ckpts, fresh_new, atomic):
    llm = LLM(ckpts.old, **ENGINE)
    before = _checksums(llm)
    with Trainer(ckpts.new_tensors, [_step(die_at_bucket=3)]) as trainer:
        _join(trainer, llm)
        meta = trainer.next("meta")
        start = time.perf_counter()
        with pytest.raises(WeightTransferError, match="receiving bucket"):
            llm.update_weights_from_distributed(meta, atomic=atomic)
        assert time.perf_counter() - start < GROUP_TIMEOUT_S  # the closed connection is seen, not waited out
        trainer.process.join(timeout=10)
        assert trainer.process.exitcode == DIE_EXIT_CODE
    assert llm.weights_version == 0
    if atomic:  # nothing was written: the old weights keep serving
        assert _checksums(llm) == before and llm.weight_report()["ready"]
        assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        return
    # fail-stop wrote some buckets: the models refuse requests until a complete update arrives
    assert not llm.weight_report()["ready"]
    with pytest.raises(WeightsNotReadyError):
        llm.forward_logprobs([PROMPT])
    with pytest.raises(WeightTransferError, match="unusable"):
        llm.update_weights_from_distributed(meta)
    with Trainer(ckpts.new_tensors, [_step()]) as trainer:  # a new group and a full update repair it
        _join(trainer, llm)
        assert llm.update_weights_from_distributed(trainer.next("meta"), atomic=False)["version"] == 1
        trainer.next("sent")
    assert llm.weight_report()["ready"] and _checksums(llm) == fresh_new["checksums"]


def test_a_trainer_that_never_sends_times_out_and_leaves_no_session_open(ckpts):
    llm = LLM(ckpts.old, **ENGINE)
    before = _checksums(llm)
    timeout = 3.0
    with Trainer(ckpts.new_tensors, [_step(skip_send=True)]) as trainer:
        wait_listening(trainer.port, QUEUE_WAIT_S)  # the engine's short timeout starts once the trainer listens
        llm.init_weight_transfer("127.0.0.1", trainer.port, timeout=timeout)
        trainer.next("joined")
        start = time.perf_counter()
        with pytest.raises(WeightTransferError, match="waiting 3 s for rank 0's acceptance"):
            llm.update_weights_from_distributed(trainer.next("meta"))
        assert time.perf_counter() - start < 5 * timeout
    assert _checksums(llm) == before and llm.weight_report()["ready"]
    assert llm.update_weights([]) == 0  # no session was left open: a new one begins (and, empty, changes nothing)


# ---- joining ----
def test_join_fails_fast_with_the_reason(ckpts):
    llm = LLM(ckpts.old, **ENGINE)
    start = time.perf_counter()
    # A port bound here and never listened on: connections to it are refused, and no other process can
    # start listening there meanwhile (as one could on a port merely found free).
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        with pytest.raises(WeightTransferError, match="could not reach the trainer's store"):
            llm.init_weight_transfer("127.0.0.1", reserved.getsockname()[1], timeout=2.0)
    assert time.perf_counter() - start < 30
    with Trainer(ckpts.new_tensors, [], world_size=3) as trainer:  # the trainer expects two engine ranks
        expected = r"trainer rank 0 has world_size=3, engine rank 1 has world_size=2"
        with pytest.raises(WeightTransferError, match=expected):
            llm.init_weight_transfer("127.0.0.1", trainer.port, timeout=GROUP_TIMEOUT_S)
        kind, message = trainer.next("error")
        assert kind == "WeightTransferError" and "world_size=2" in message
    with pytest.raises(WeightTransferError, match="init_weight_transfer"):
        llm.update_weights_from_distributed({"update_id": "x"})
    for bad, match in (({"backend": "mpi"}, "backend"), ({"world_size": 1}, "world_size"),
                       ({"rank_offset": 2}, "rank"), ({"timeout": 0}, "timeout")):
        with pytest.raises(ConfigError, match=match):
            llm.init_weight_transfer("127.0.0.1", free_port(), **bad)
    with pytest.raises(ConfigError, match="master_port"):
        llm.init_weight_transfer("127.0.0.1", 0)


# ---- colocated: shared memory, the same metadata ----
def test_colocated_update_through_shared_memory_equals_an_in_process_update(ckpts):
    hf = ref.hf_state_from_native(ref.native_state_dict(ref.build_reference_model(ref.tiny_config(), NEW_SEED)),
                                  ref.tiny_config())
    hf = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in hf.items()}  # a trainer's bf16
    shared, direct = LLM(ckpts.old, **ENGINE), LLM(ckpts.old, **ENGINE)
    built = _pointers(shared)
    with ColocatedWeightSender() as sender:
        meta = sender.plan(hf, bucket_bytes=SMALL_BUCKETS, base_version=0)
        handle = sender.share(hf, meta)
        with pytest.raises(WeightUpdateError, match="refusing to map"):
            shared.update_weights_from_shared(meta, {**handle, "path": "/etc/hostname"})
        assert shared.update_weights_from_shared(meta, handle)["version"] == 1
        with pytest.raises(WeightUpdateError, match="based on weights version 0"):
            shared.update_weights_from_shared(meta, handle)  # version 1 now
        path = Path(handle["path"])
        assert path.exists() and path.stat().st_mode & 0o777 == 0o600
    assert not path.exists()  # released
    direct.update_weights(hf.items())
    assert _checksums(shared) == _checksums(direct) and _pointers(shared) == built


# ---- a bucket's checksum against its staging ----
@pytest.mark.parametrize("corruption", ["value", "invalid"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "fail_stop"])
def test_a_corrupted_bucket_is_refused_before_any_live_write(ckpts, atomic, corruption):
    """Atomic sessions hash each tensor as they stage it and check the bucket's checksum at its end;
    fail-stop ones check it before loading. Either way a corrupted bucket (a changed value, or bytes that
    also fail validation, reported as the checksum failure they are) writes nothing live."""
    from safetensors.torch import load_file

    from dsv4.rl.plan import pack_bucket, plan_buckets
    from dsv4.weights.transfer import apply_bucket

    tensors = load_file(str(ckpts.new_tensors))
    plan = plan_buckets(tensors, SMALL_BUCKETS)
    # a bucket with tensors before one of its scales: an atomic session stages them before it fails
    index = next(i for i, b in enumerate(plan.buckets) if any(e.dtype == "float8_e8m0fnu" for e in b.tensors[1:]))
    bucket = plan.buckets[index]
    buffer = pack_bucket(bucket, tensors, torch.empty(bucket.nbytes, dtype=torch.uint8))
    if corruption == "value":  # the last byte of the bucket: a value that stays valid
        buffer[-1] ^= 1
    else:  # an e8m0 scale's NaN byte, which validation alone would also refuse
        entry = next(e for e in bucket.tensors[1:] if e.dtype == "float8_e8m0fnu")
        buffer[entry.offset] = 0xFF
    llm = LLM(ckpts.old, **ENGINE)
    before = _checksums(llm)
    session = llm.begin_weight_update(atomic=atomic)
    with pytest.raises(WeightUpdateError, match=rf"bucket {index}: checksum"):
        apply_bucket(session, plan, index, buffer)
    session.abort()
    assert _checksums(llm) == before and llm.weight_report()["ready"]
