"""A GGUF file's reader and its metadata values: what the tokenizer (models.gguf_tokenizer) and the
model (models.gguf) both read, so neither imports the other for it."""
from __future__ import annotations

from pathlib import Path

import gguf

from models.errors import CheckpointError

_REQUIRED = object()


def open_gguf(path) -> gguf.GGUFReader:
    """The file's metadata parsed and its tensors memory-mapped (read when dequantized)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except ValueError as e:  # gguf-py's message for a bad magic or version
        raise CheckpointError(f"{path}: not a GGUF file ({e}); a checkpoint is a directory or a .gguf file") from e


def field(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    """A metadata value (a number, a string, a bool or a list of them), `default` when absent."""
    f = reader.get_field(key)
    if f is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{reader.data.filename}: required metadata {key!r} is missing")
        return default
    return f.contents()
