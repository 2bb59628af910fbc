"""The checkpoint's chat template (tokenizer_config.json `chat_template`, a Jinja2 string) -> prompt text.

Rendered as transformers does: a sandboxed Jinja2 environment with trim_blocks/lstrip_blocks, the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception`.
jinja2 is imported only here, when a chat is rendered.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4.errors import ConfigError, RequestError

TOKENIZER_CONFIG = "tokenizer_config.json"
DEFAULT_TEMPLATE_NAME = "default"


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self._special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, path: Path) -> ChatTemplate | None:
        """The template of checkpoint dir `path`, or None when it has none."""
        file = Path(path) / TOKENIZER_CONFIG
        if not file.exists():
            return None
        try:
            config = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}: invalid JSON ({exc})") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get(DEFAULT_TEMPLATE_NAME)
        if not source:
            return None
        if not isinstance(source, str):
            raise ConfigError(f"{file}: chat_template must be a string or a list of named templates")
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError

        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise RequestError(f"chat messages must be dicts with a 'role', got {message!r}")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special_tokens
            )
        except TemplateError as exc:
            raise RequestError(f"chat template: {exc}") from None


def _token_text(token) -> str:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return "" if token is None else str(token)
