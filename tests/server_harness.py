"""A real `dsv4 serve` process on 127.0.0.1 for the server tests, and the checkpoints they serve.

`ServerProcess` starts `python -m dsv4 serve ...` on a free loopback port, waits for /health (with a
deadline), and kills the process on `stop()`; module-scoped fixtures keep one process per test module.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dsv4.embedded import DEFAULT_MODEL, EMBEDDED_MODELS

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0  # loading the embedded model takes ~1 s; the rest is a contended machine
STOP_TIMEOUT_S = 20.0
POLL_S = 0.1
# The embedded sorting model's task as a conversation: the user's message is the digits to sort.
SORT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "sort {{ message['content'] }}={% endif %}{% endfor %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def sort_checkpoint_with_chat_template(directory: Path) -> Path:
    """A copy of the embedded default model plus a tokenizer_config.json with a chat template."""
    source = EMBEDDED_MODELS[DEFAULT_MODEL][0]
    directory.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        shutil.copy(file, directory / file.name)
    config = {"chat_template": SORT_CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


class ServerProcess:
    """`dsv4 serve MODEL ARGS...` on a free loopback port, ready (health OK) when constructed."""

    def __init__(self, model: str | Path, *args: str, log_file: Path):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        command = [sys.executable, "-m", "dsv4", "serve", str(model), "--host", HOST, "--port", str(self.port),
                   "--threads", "1", "--log-level", "warning", *args]
        self.log_file = log_file
        self._log = log_file.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dsv4 serve exited with {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(POLL_S)
        self.stop()
        raise RuntimeError(f"dsv4 serve not healthy after {START_TIMEOUT_S} s: {self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_file.read_text()[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        self._log.close()


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"dsv4:{name}{{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` until it returns a truthy value (returned) or the deadline passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)
