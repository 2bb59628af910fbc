"""The served model as the HTTP layer sees it: its name, limits, and its text <-> token conversions.

Prompts are tokenized here, on the event loop, so the engine thread only ever sees token ids; generated
text comes out of the engine already detokenized incrementally (one `IncrementalDetokenizer` per
sequence), so nothing here re-decodes a growing history. The only per-token decoding done here is of
single tokens, for logprobs, and only when a request asks for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsv4.engine.chat_template import ChatTemplate
from dsv4.engine.llm import LLM
from dsv4.errors import RequestError
from dsv4.server.errors import ApiError
from dsv4.server.protocol import ChatMessage


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None  # tokenizers.Tokenizer
    chat_template: ChatTemplate | None

    @classmethod
    def from_llm(cls, llm: LLM, name: str) -> ServedModel:
        return cls(name, llm.limits.max_model_len, llm.config.vocab_size, llm.tokenizer, llm.chat_template)

    def check_name(self, requested: str | None) -> None:
        """Raises ApiError (404, `model`) unless `requested` is None or this model's name."""
        if requested is not None and requested != self.name:
            raise ApiError(f"model {requested!r} does not exist; this server serves {self.name!r}",
                           status=404, param="model", code="model_not_found")

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """`text` as token ids (the tokenizer's special tokens, e.g. BOS, added unless told not to).

        Raises:
            ApiError: the model has no tokenizer (`param` names the field that held the text).
        """
        if self.tokenizer is None:
            raise ApiError("this model has no tokenizer: give prompts as lists of token ids", param=param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        """`ids` as a list, once every id is known to be in the vocabulary.

        Raises:
            ApiError: naming `param` and the first id out of range.
        """
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ApiError(f"{param}: token id {bad} is out of range [0, {self.vocab_size})", param=param)
        return list(ids)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool) -> tuple[str, list[int]]:
        """The conversation as prompt text (the checkpoint's chat template) and its token ids.

        Raises:
            ApiError: the model has no chat template or tokenizer, or the template refused the messages.
        """
        if self.chat_template is None or self.tokenizer is None:
            raise ApiError(f"model {self.name!r} has no chat template: use /v1/completions", param="messages")
        try:
            text = self.chat_template.render([{"role": m.role, "content": m.text()} for m in messages],
                                             add_generation_prompt)
        except RequestError as exc:  # the template's own raise_exception(...)
            raise ApiError(str(exc), param="messages") from None
        # The template writes any BOS itself, so special tokens are not added again.
        return text, self.encode(text, "messages", add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens skipped ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included, e.g. "</s>")."""
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
