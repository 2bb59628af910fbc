"""The checksum a weight update carries per bucket, so that an update that reports success provably
moved the bytes the trainer planned: XXH3-64 (the `xxhash` library) over the bucket's packed bytes.

XXH3 is not cryptographic; it guards against transport and packing faults (a buffer never received, a
stale bucket, a shifted offset, values changed between plan and send), not against an attacker, who
would need the admin token or a place in the transfer group anyway. It runs at several times the speed
of sha256 (measured ~8 GB/s vs ~0.9 GB/s on the development VM), so verifying every bucket costs less
than copying it.
"""

from __future__ import annotations

import torch
import xxhash

ALGORITHM = "xxh3-64"
_PREFIX = ALGORITHM + ":"


class BucketHasher:
    """Incremental checksum over a bucket's bytes: tensor payloads and the zero padding between them."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()

    def update(self, raw: torch.Tensor) -> None:
        """Add the bytes of a flat uint8 tensor (copied to the host first when it lives on a GPU)."""
        self._hash.update(_host_bytes(raw))

    def update_zeros(self, count: int) -> None:
        if count:
            self._hash.update(bytes(count))

    def hexdigest(self) -> str:
        return _PREFIX + self._hash.hexdigest()


def bucket_checksum(buffer: torch.Tensor) -> str:
    """Checksum of a packed bucket (a flat uint8 tensor holding exactly the bucket's bytes)."""
    hasher = BucketHasher()
    hasher.update(buffer)
    return hasher.hexdigest()


def is_checksum(value: object) -> bool:
    """Whether `value` is a checksum string in this module's format."""
    if not isinstance(value, str) or not value.startswith(_PREFIX):
        return False
    digits = value[len(_PREFIX) :]
    return len(digits) == 16 and all(c in "0123456789abcdef" for c in digits)


def text_checksum(text: str) -> str:
    """Checksum of a string (the canonical JSON of a plan: both ends compare it to agree on the plan)."""
    return _PREFIX + xxhash.xxh3_64_hexdigest(text.encode())


def _host_bytes(raw: torch.Tensor) -> memoryview:
    if raw.device.type != "cpu":
        raw = raw.cpu()  # GPU buckets are hashed on the host: one device-to-host copy per bucket
    return memoryview(raw.contiguous().numpy())
