"""The checkpoint's chat template (tokenizer_config.json `chat_template`, a Jinja2 string) -> prompt text.

Rendered as transformers does: a sandboxed Jinja2 environment with trim_blocks/lstrip_blocks, the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception`.
jinja2 is imported only here, when a checkpoint with a template is opened.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4.engine.validation import check_message
from dsv4.errors import ConfigError, RequestError

TOKENIZER_CONFIG = "tokenizer_config.json"
DEFAULT_TEMPLATE_NAME = "default"
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token")


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja2 template text.
        special_tokens: values of the template variables `bos_token` and `eos_token`.
        origin: where the template came from, for error messages.

    Raises:
        ConfigError: the template is not valid Jinja2.
    """

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str = "chat_template"):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ConfigError(f"{origin}: chat_template is not a valid Jinja2 template ({exc})") from None
        self._special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint directory.

        Args:
            path: the checkpoint directory.

        Returns:
            The template, or None when the directory has no tokenizer_config.json or it has no template.

        Raises:
            ConfigError: tokenizer_config.json is not valid JSON, or its template is malformed.
        """
        file = Path(path) / TOKENIZER_CONFIG
        if not file.exists():
            return None
        try:
            config = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: invalid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{file}: expected a JSON object at the top level")
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get(DEFAULT_TEMPLATE_NAME)
        if not source:
            return None
        if not isinstance(source, str):
            raise ConfigError(f"{file}: chat_template must be a string or a list of named templates")
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_FIELDS}
        return cls(source, special, origin=str(file))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of one conversation.

        Args:
            messages: dicts with a string 'role' and 'content'.
            add_generation_prompt: end with the text that opens the assistant's turn.

        Returns:
            The text to tokenize (without adding special tokens: the template writes them).

        Raises:
            ArgumentTypeError: a malformed message.
            RequestError: the template rejects the conversation (e.g. an unsupported role).
        """
        from jinja2.exceptions import TemplateError

        for i, message in enumerate(messages):
            check_message(message, f"chat: messages[{i}]")
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
