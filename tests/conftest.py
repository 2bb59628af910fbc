import pytest
import torch

# The test models are tiny: their forwards are dispatch-bound, and intra-op threads only add
# synchronisation overhead (severe when the machine's two cores are shared).
torch.set_num_threads(1)


def _write_word_tokenizer(path, vocab: int, tokenizer_config: dict | None = None) -> None:
    """A word-level tokenizer over `vocab` ids: id i <-> "w{i}", words joined by spaces when decoded."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.fixture(scope="session")
def write_word_tokenizer():
    """`write(path, vocab, tokenizer_config=None)`: give a test checkpoint a word-level tokenizer
    (id i <-> "w{i}"), so text, stop strings and chat templates can be tested on random models."""
    return _write_word_tokenizer
