"""Tests for IncrementalDetokenizer and the stop-string helpers."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv4.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringChecker,
    find_stop,
    partial_stop_length,
    truncate_at_stop,
)

EOS = "<eos>"
# Small enough that most multi-byte characters stay split across tokens.
TRAIN_VOCAB_SIZE = 300
CORPUS = [
    "héllo wörld 日本語 🙂",
    "hello world, hello tokenizer",
    "naïve café über straße",
    "日本語のテキスト 🙂🙃 emoji",
    "the quick brown fox jumps over the lazy dog",
] * 20
TEXTS = [
    "héllo wörld 日本語 🙂",
    "naïve 🙃 café — 日本 straße",
    "plain ascii text",
    "🙂🙂🙂",
    "mixed: é日🙂é日🙂",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A tiny byte-level BPE trained on text with multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TRAIN_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by ByteLevel (de)coding."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@pytest.fixture(scope="module")
def cross_char_tokenizer() -> tuple[Tokenizer, dict[bytes, int]]:
    """A byte-level tokenizer whose vocab has tokens that straddle characters.

    Built from an explicit vocab (no merges needed: only decoding is used), so
    a test can feed token sequences in which *every* token ends inside a
    character, which a trained BPE would produce only by chance.
    """
    byte_char = _bytes_to_unicode()
    pieces = [bytes([b]) for b in range(256)]
    text = "日本語".encode()  # e6 97 a5 | e6 9c ac | e8 aa 9e
    pieces += [text[0:2], text[2:4], text[4:7], text[7:9]]
    vocab = {"".join(byte_char[b] for b in piece): i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return tok, {piece: i for i, piece in enumerate(pieces)}


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add_token(i) for i in ids]
    deltas.append(detok.finish())
    return deltas


# ---------------------------------------------------------------------------
# IncrementalDetokenizer
# ---------------------------------------------------------------------------


def test_tokenizer_really_splits_characters(tokenizer):
    """Guard: the streaming tests are only meaningful if some tokens are
    fragments of a multi-byte character."""
    fragments = [
        i for text in TEXTS for i in tokenizer.encode(text).ids
        if REPLACEMENT_CHAR in tokenizer.decode([i])
    ]
    assert fragments


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_break_characters_and_concatenate_to_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = _stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text
    assert detok.token_ids == ids


def test_random_id_sequences_concatenate_to_decode(tokenizer):
    """Arbitrary ids (possibly invalid UTF-8) still reassemble exactly, once
    finish() releases a genuinely broken tail."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 30))]
        deltas = _stream(IncrementalDetokenizer(tokenizer), ids)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_text_is_emitted_as_soon_as_characters_complete(cross_char_tokenizer):
    tok, ids_of = cross_char_tokenizer
    text = "日本語".encode()
    ids = [ids_of[text[0:2]], ids_of[text[2:4]], ids_of[text[4:7]], ids_of[text[7:9]]]
    # Every token but the last ends inside a character, so each decoded
    # prefix ends in U+FFFD; the completed characters must still stream.
    detok = IncrementalDetokenizer(tok)
    assert [detok.add_token(i) for i in ids] == ["", "日", "本", "語"]
    assert detok.finish() == ""


def test_held_back_bytes_are_released_by_finish(cross_char_tokenizer):
    tok, ids_of = cross_char_tokenizer
    detok = IncrementalDetokenizer(tok)
    assert detok.add_token(ids_of[b"A"]) == "A"
    assert detok.add_token(ids_of[b"\xe6"]) == ""  # lead byte of a 3-byte char
    assert detok.finish() == REPLACEMENT_CHAR
    assert detok.text == "A" + REPLACEMENT_CHAR


def test_prompt_is_context_only(tokenizer):
    prompt = tokenizer.encode("héllo wörld 日本").ids
    generated = tokenizer.encode("語 🙂 café").ids
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    deltas = _stream(detok, generated)
    assert "".join(deltas) == tokenizer.decode(generated)
    assert detok.token_ids == generated


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.token_to_id(EOS)
    ids = [*tokenizer.encode("日本").ids, eos]
    assert "".join(_stream(IncrementalDetokenizer(tokenizer), ids)) == "日本"
    kept = "".join(_stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert kept == "日本" + EOS


# ---------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------


def test_find_and_truncate_pick_the_earliest_stop():
    assert find_stop("abc STOP def END", ["END", "STOP"]) == (4, "STOP")
    assert find_stop("no stop here", ["END"]) is None
    assert truncate_at_stop("abc STOP def END", ["END", "STOP"]) == ("abc ", "STOP")
    assert truncate_at_stop("abc", []) == ("abc", None)
    assert truncate_at_stop("END", ["END"]) == ("", "END")


@pytest.mark.parametrize(
    "text, stops, expected",
    [
        ("hello wor", ["world"], 3),
        ("hello world", ["world"], 0),  # a whole stop is a match, not a partial
        ("hello", ["world"], 0),
        ("xaba", ["abac", "b"], 3),
        ("abab", ["abac", "b"], 2),
        ("x\n", ["\n\n", "\nUser:"], 1),
        ("", ["a"], 0),
    ],
)
def test_partial_stop_length(text, stops, expected):
    assert partial_stop_length(text, stops) == expected


STOP_CASES = [
    # (full text, stops)
    ("The answer is 42.\n\nUser: next", ["\n\nUser:"]),
    ("abcabd and abc", ["abd"]),  # "ab" is a false start first, then completes
    ("nothing to stop here", ["STOP", "END"]),
    ("早上好 日本語 END 🙂", ["日本語 E", "🙂"]),
    ("aaab", ["aab", "ab"]),  # overlapping candidates, earliest wins
    ("stop at start", ["stop"]),
]


@pytest.mark.parametrize("full, stops", STOP_CASES)
@pytest.mark.parametrize("chunking", ["chars", "random"])
def test_streamed_stop_output_never_needs_retraction(full, stops, chunking):
    expected, expected_stop = truncate_at_stop(full, stops)
    rng = random.Random(1)
    chunks, i = [], 0
    while i < len(full):
        size = 1 if chunking == "chars" else rng.randint(1, 4)
        chunks.append(full[i : i + size])
        i += size

    checker = StopStringChecker(stops)
    streamed = ""
    stop = None
    for chunk in chunks:
        delta, stop = checker.feed(chunk)
        streamed += delta
        # Everything streamed so far is final: a prefix of the truncated text,
        # so no delta ever carried part of the stop string.
        assert expected.startswith(streamed), (streamed, expected)
        if stop is not None:
            break
    if stop is None:
        streamed += checker.finish()
    assert stop == expected_stop
    assert streamed == expected == checker.text


def test_checker_holds_a_false_start_until_it_diverges():
    checker = StopStringChecker(["END"])
    assert checker.feed("the E") == ("the ", None)
    assert checker.feed("N") == ("", None)
    assert checker.feed("D") == ("", "END")
    assert checker.text == "the "
    assert checker.finish() == ""
    with pytest.raises(RuntimeError):
        checker.feed("more")

    released = StopStringChecker(["END"])
    assert released.feed("the EN") == ("the ", None)
    assert released.feed("Ds") == ("", "END")
    other = StopStringChecker(["END"])
    other.feed("the EN")
    assert other.feed("ter") == ("ENter", None)


def test_detokenizer_and_checker_together(tokenizer):
    """A stop string split across tokens never leaks into the stream."""
    text = "héllo wörld 日本語 🙂 café"
    stops = ["日本語 🙂"]
    detok = IncrementalDetokenizer(tokenizer)
    checker = StopStringChecker(stops)
    streamed, stop = "", None
    for token in tokenizer.encode(text).ids:
        delta, stop = checker.feed(detok.add_token(token))
        streamed += delta
        assert "日" not in streamed
        if stop:
            break
    assert stop == "日本語 🙂"
    assert streamed == "héllo wörld "
