"""`dsv4 serve`: its arguments and what it runs (load the model, build the app, serve it with uvicorn).

    dsv4 serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key K] [--admin-token T]
               [--weights-root DIR] [--draft mtp|dspark] [--num-speculative-tokens K] [engine limits ...]

MODEL is a checkpoint directory or an embedded model's name (default: the embedded default model).
The server binds to loopback unless told otherwise. Secrets may come from the environment
(DSV4_API_KEY, DSV4_ADMIN_TOKEN) rather than the command line, where other users can read them.
This module imports nothing heavy at import time: the CLI builds its parser from it on every command.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from dsv4.cli.arguments import add_engine_arguments
from dsv4.server.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUCKET_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_PORT,
    LOOPBACK,
)

API_KEY_ENV = "DSV4_API_KEY"
ADMIN_TOKEN_ENV = "DSV4_ADMIN_TOKEN"
# Open connections uvicorn accepts before answering 503 (each streaming client holds one).
DEFAULT_MAX_CONNECTIONS = 2048
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
log = logging.getLogger("dsv4.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="checkpoint directory or embedded model name (default: the embedded default model)")
    parser.add_argument("--host", default=LOOPBACK, help="address to bind (loopback only unless told otherwise)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port to listen on")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require this bearer token on /v1 routes (or set {API_KEY_ENV})")
    parser.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV),
                        help=f"enable the /admin routes, guarded by this bearer token (or set {ADMIN_TOKEN_ENV})")
    parser.add_argument("--weights-root", type=Path, default=None,
                        help="the only directory /admin/weights/reload may read checkpoints from")
    parser.add_argument("--served-model-name", default=None, help="the name clients give as `model`")
    add_engine_arguments(parser)
    parser.add_argument("--speculation-max-batch", type=int, default=None,
                        help="speculate only in steps with at most this many decoding sequences")
    parser.add_argument("--no-share-prompt-prefill", dest="share_prompt_prefill", action="store_false",
                        help="prefill every sequence's prompt itself, also when others share it (default: once)")
    parser.add_argument("--expert-dtype", choices=("fp4", "fp8", "dense"), default=None,
                        help="resident format of the routed experts (default: the checkpoint's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="cache slots (sequences decoded together)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per forward step")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + output tokens per sequence (default: sized from the model and memory)")
    parser.add_argument("--seed", type=int, default=0, help="seed of dummy weights and unseeded sampling")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted on /v1 routes (413 beyond)")
    parser.add_argument("--max-bucket-bytes", type=int, default=DEFAULT_MAX_BUCKET_BYTES,
                        help="largest safetensors body accepted by /admin/weights/bucket")
    parser.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="requests waiting for the engine before new ones get 503")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="open connections accepted before answering 503")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="server and uvicorn log level")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted. Returns the exit code."""
    import torch
    import uvicorn

    from dsv4.embedded import DEFAULT_MODEL
    from dsv4.engine.llm import LLM
    from dsv4.errors import ConfigError
    from dsv4.server.app import build_app
    from dsv4.server.config import ServerConfig

    for name in ("port", "max_body_bytes", "max_bucket_bytes", "max_queued_requests", "max_connections", "threads"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "port" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.weights_root is not None and not args.weights_root.is_dir():
        raise ConfigError(f"--weights-root {args.weights_root}: not a directory")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model, dtype=args.dtype, activation_dtype=args.activation_dtype, device=args.device,
              seed=args.seed, draft=args.draft, expert_dtype=args.expert_dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              num_speculative_tokens=args.num_speculative_tokens, speculation_max_batch=args.speculation_max_batch,
              share_prompt_prefill=args.share_prompt_prefill)
    config = ServerConfig(
        model_name=args.served_model_name or (args.model if args.model is not None else DEFAULT_MODEL),
        api_key=args.api_key or None, admin_token=args.admin_token or None, weights_root=args.weights_root,
        max_body_bytes=args.max_body_bytes, max_bucket_bytes=args.max_bucket_bytes,
        max_queued_requests=args.max_queued_requests,
    )
    if args.host not in (LOOPBACK, "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    log.info("dsv4 serve: %s on http://%s:%d (weights version %d, admin routes %s)", config.model_name, args.host,
             args.port, llm.weights_version, "on" if config.admin_token else "off")
    uvicorn.run(build_app(llm, config), host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.access_log, limit_concurrency=args.max_connections)
    return 0
