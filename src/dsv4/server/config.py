"""How one server is set up (frozen; built by `dsv4 serve` from its arguments)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEBIBYTE = 1 << 20
# A /v1 request body: prompts of a few hundred thousand token ids in JSON fit; anything larger is
# refused before it is read whole.
DEFAULT_MAX_BODY_BYTES = 16 * MEBIBYTE
# A weights bucket (safetensors bytes, held in memory twice while parsed): large enough for the
# 512 MiB-1 GiB buckets trainers send.
DEFAULT_MAX_BUCKET_BYTES = 2048 * MEBIBYTE
# Engine requests queued or running at once before new ones are refused with 503.
DEFAULT_MAX_QUEUED_REQUESTS = 4096
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServerConfig:
    """Args:
        model_name: the name clients use in `model` (and /v1/models lists).
        api_key: required as `Authorization: Bearer KEY` on /v1 routes when set.
        admin_token: enables the /admin routes (404 without it), required as a bearer token on them.
        weights_root: the only directory /admin/weights/reload may read checkpoints from (None: off).
        max_body_bytes: limit of a request body on every route but the weights bucket.
        max_bucket_bytes: limit of a /admin/weights/bucket body.
        max_queued_requests: engine requests queued or running at once.
    """

    model_name: str
    api_key: str | None = None
    admin_token: str | None = None
    weights_root: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
