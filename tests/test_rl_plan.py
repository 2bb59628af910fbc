"""The weight-sync plan (`dsv4.rl.plan`): bucket layout, JSON round trip, validation of metadata an engine
receives, packing and zero-copy views for every dtype that may travel, and checksums that catch one byte."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.errors import WeightUpdateError
from dsv4.rl.checksum import bucket_checksum
from dsv4.rl.plan import ALIGNMENT, DTYPES, WeightSyncPlan, bucket_views, check_tensors_match, pack_bucket, plan_buckets


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, (name, dtype) in enumerate(DTYPES.items()):
        shape = (3, 5 + i) if i % 2 else (7 + i,)
        raw = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
        if dtype.itemsize == 1:
            out[f"t.{name}"] = raw.view(dtype)
        else:
            out[f"t.{name}"] = torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else raw.to(dtype)
    out["scalar"] = torch.tensor(2.5)
    out["big"] = torch.randn(64, 64, generator=g)  # 16 KiB: more than one bucket by itself
    return out


def test_layout_alignment_buckets_and_an_oversize_tensor_alone():
    tensors = _tensors()
    plan = plan_buckets(tensors, bucket_bytes=256, base_version=3)
    entries = [t for b in plan.buckets for t in b.tensors]
    assert [t.name for t in entries] == list(tensors)  # order kept
    assert all(t.offset % ALIGNMENT == 0 for t in entries)
    for b in plan.buckets:
        assert b.nbytes == b.tensors[-1].end
        assert len(b.tensors) == 1 or b.nbytes <= 256
        for prev, nxt in zip(b.tensors, b.tensors[1:]):
            assert nxt.offset >= prev.end
    (big,) = [b for b in plan.buckets if any(t.name == "big" for t in b.tensors)]
    assert len(big.tensors) == 1 and big.nbytes == 64 * 64 * 4
    assert plan.buffer_bytes == big.nbytes and plan.base_version == 3
    assert plan.total_bytes == sum(b.nbytes for b in plan.buckets) and plan.num_tensors == len(tensors)


def test_pack_and_views_round_trip_every_dtype_bit_exactly():
    tensors = _tensors()
    plan = WeightSyncPlan.from_json(json.loads(json.dumps(plan_buckets(tensors, bucket_bytes=512).to_json())))
    buffer = torch.full((plan.buffer_bytes,), 0xAB, dtype=torch.uint8)  # stale bytes must not leak into padding
    seen = {}
    for bucket in plan.buckets:
        packed = pack_bucket(bucket, tensors, buffer)
        assert bucket_checksum(packed) == bucket.checksum
        seen.update({name: view.clone() for name, view in bucket_views(bucket, packed)})
    assert seen.keys() == tensors.keys()
    for name, t in tensors.items():
        assert seen[name].dtype == t.dtype and seen[name].shape == t.shape
        assert torch.equal(seen[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_json_round_trip_and_digest():
    plan = plan_buckets(_tensors(), bucket_bytes=1024, base_version=None)
    again = WeightSyncPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.digest() == plan.digest()
    assert plan_buckets(_tensors(), bucket_bytes=1024).digest() != plan.digest()  # every plan has its own id


def test_a_flipped_byte_changes_the_checksum():
    tensors = _tensors()
    plan = plan_buckets(tensors, bucket_bytes=1 << 20)
    packed = pack_bucket(plan.buckets[0], tensors, torch.empty(plan.buffer_bytes, dtype=torch.uint8)).clone()
    packed[packed.numel() // 2] ^= 1
    assert bucket_checksum(packed) != plan.buckets[0].checksum


def _meta() -> dict:
    return plan_buckets({"a": torch.ones(4), "b": torch.ones(2, 2, dtype=torch.bfloat16)}, bucket_bytes=1024).to_json()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(protocol="other/1"), "protocol"),
        (lambda m: m.update(base_version=-1), "base_version"),
        (lambda m: m["buckets"][0]["tensors"][1].update(dtype="complex64"), "dtype 'complex64'"),
        (lambda m: m["buckets"][0]["tensors"][1].update(offset=8), "offset 8"),
        (lambda m: m["buckets"][0]["tensors"][1].update(offset=0), "overlaps"),
        (lambda m: m["buckets"][0]["tensors"][0].update(shape=[4, -1]), "bad shape"),
        (lambda m: m["buckets"][0].update(nbytes=1 << 40), "nbytes"),
        (lambda m: m["buckets"][0].update(checksum="md5:00"), "checksum"),
        (lambda m: m["buckets"][0]["tensors"][1].update(name="a"), "listed twice"),
        (lambda m: m.pop("buckets"), "missing field 'buckets'"),
        (lambda m: m.update(bucket_bytes="1"), "bucket_bytes"),
    ],
)
def test_malformed_metadata_is_refused_naming_the_field(edit, match):
    meta = _meta()
    edit(meta)
    with pytest.raises(WeightUpdateError, match=match):
        WeightSyncPlan.from_json(meta)


def test_bad_trainer_input_is_refused_naming_the_tensor():
    with pytest.raises(WeightUpdateError, match=r"'c'.*complex"):
        plan_buckets({"c": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(WeightUpdateError, match=r"'x': expected a torch\.Tensor"):
        plan_buckets([("x", [1.0])])
    with pytest.raises(WeightUpdateError, match="bucket_bytes"):
        plan_buckets({"a": torch.ones(1)}, bucket_bytes=0)
    plan = plan_buckets({"a": torch.ones(4)})
    with pytest.raises(WeightUpdateError, match="'a' is float32 \\[2\\]"):
        check_tensors_match(plan, {"a": torch.ones(2)})
    with pytest.raises(WeightUpdateError, match="missing \\['a'\\]"):
        check_tensors_match(plan, {"b": torch.ones(4)})
