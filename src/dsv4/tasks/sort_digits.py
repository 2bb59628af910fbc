"""Digit sorting: the embedded default model's task.

A person types `sort 31402=` and the model answers `01234`: the digits of the prompt in ascending
order (duplicates kept), then end of sequence. The prompt holds 1..MAX_DIGITS digits.

This module is the single definition of the task: prompt format, seeded data generator, answer
checker, and the character-level tokenizer and chat template the model ships with. Training
(`scripts/train_embedded.py`) and evaluation (`dsv4.evaluate`) both use it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAME = "sort_digits"
PREFIX = "sort "
SEPARATOR = "="
MIN_DIGITS = 1
MAX_DIGITS = 8
DIGITS = "0123456789"

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
# Token ids: specials first (bos 0, eos 1 as the config says), then every character a person may type.
SPECIALS = (BOS, EOS, UNK)
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz =+-*/:,.?"
VOCAB = SPECIALS + tuple(CHARS)
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2
# A few prompts that show the task (`dsv4 generate` with no prompt uses them).
DEMO_PROMPTS = ("sort 31402=", "sort 9081726=", "sort 55512=", "sort 7=", "sort 86420135=")
# Longest prompt + answer + eos, plus bos.
MAX_SEQ_LEN = 1 + len(PREFIX) + MAX_DIGITS + len(SEPARATOR) + MAX_DIGITS + 1


@dataclass(frozen=True)
class Example:
    prompt: str  # e.g. "sort 31402="
    answer: str  # e.g. "01234"


def make_prompt(digits: str) -> str:
    return f"{PREFIX}{digits}{SEPARATOR}"


def solve(prompt: str) -> str | None:
    """The correct answer to a prompt in the task's format, or None if it is not one."""
    if not (prompt.startswith(PREFIX) and prompt.endswith(SEPARATOR)):
        return None
    digits = prompt[len(PREFIX) : -len(SEPARATOR)]
    if not (MIN_DIGITS <= len(digits) <= MAX_DIGITS and digits.isdigit() and digits.isascii()):
        return None
    return "".join(sorted(digits))


def is_correct(prompt: str, output: str) -> bool:
    """Exact match of the model's output text (eos stripped) against the answer."""
    answer = solve(prompt)
    return answer is not None and output.strip() == answer


def sample(rng: random.Random) -> Example:
    """A random length, and digits drawn from a random subset of 1..10 distinct digits, so that inputs
    with long runs of repeated digits ("sort 7757757=") are as common as all-different ones."""
    n = rng.randint(MIN_DIGITS, MAX_DIGITS)
    pool = rng.sample(DIGITS, rng.randint(1, len(DIGITS)))
    digits = "".join(rng.choice(pool) for _ in range(n))
    prompt = make_prompt(digits)
    return Example(prompt, solve(prompt))  # type: ignore[arg-type]


def examples(n: int, seed: int) -> list[Example]:
    """n seeded examples (the same seed always gives the same list)."""
    rng = random.Random(seed)
    return [sample(rng) for _ in range(n)]


# ---- tokenizer ----
def build_tokenizer():
    """Character-level `tokenizers.Tokenizer`: WordLevel over single characters, a Split pre-tokenizer
    that isolates every character, bos prepended by the post-processor, a Fuse decoder (no spaces
    inserted between characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([BOS, EOS, UNK])
    return tok


# The task has no context: an answer depends only on its own prompt. So a chat is answered by rendering
# its last message, which must be the user's prompt in the task's format; earlier turns cannot change the
# answer and are left out. The bos token comes from the template (chat prompts are encoded without
# adding special tokens).
CHAT_TEMPLATE = (
    "{% set last = messages[-1] %}"
    "{% if last['role'] != 'user' %}"
    "{{ raise_exception('the last message must be the user\\'s, e.g. \\'sort 31402=\\'') }}"
    "{% endif %}"
    "{{ bos_token }}{{ last['content'] }}"
)


def tokenizer_config() -> dict:
    """The embedded models' tokenizer_config.json: special tokens and the chat template, in the form
    transformers' tokenizers read as well."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def encode(text: str) -> list[int]:
    """Token ids of `text` without bos (training builds sequences from these)."""
    ids = []
    for ch in text:
        ids.append(VOCAB.index(ch) if ch in CHARS else UNK_ID)
    return ids


def training_ids(ex: Example) -> tuple[list[int], int]:
    """(bos + prompt + answer + eos, index of the first answer token)."""
    prompt = [BOS_ID, *encode(ex.prompt)]
    return prompt + encode(ex.answer) + [EOS_ID], len(prompt)
