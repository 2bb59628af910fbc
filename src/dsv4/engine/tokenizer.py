"""The checkpoint's tokenizer (`tokenizer.json`, Hugging Face `tokenizers` format), opened before any weight
loads so that a broken file fails fast and names itself."""

from __future__ import annotations

from pathlib import Path

from dsv4.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | Path):
    """Open a checkpoint directory's tokenizer.

    Args:
        path: the checkpoint directory.

    Returns:
        A `tokenizers.Tokenizer`, or None when the directory has no tokenizer.json (prompts must then be
        token ids).

    Raises:
        ConfigError: the file cannot be parsed (the message names it).
    """
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for any malformed file
        if isinstance(exc, MemoryError):
            raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{file}: not a valid tokenizer ({reason})") from None
