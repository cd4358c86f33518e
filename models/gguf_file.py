"""A GGUF file's metadata and tensor table, and its tensors memory-mapped: what the tokenizer
(models.gguf_tokenizer) and the model (models.gguf) both read, so neither imports the other for it.

Parsed here rather than by gguf-py's `GGUFReader`, which builds a numpy view for every element of
every metadata array: 2.4 s for SmolLM2's 49k-token vocabulary and its merges, and several times that
for Gemma's 256k (three arrays of it: tokens, scores, types). Here a numeric array is one
`np.frombuffer` and a string one a loop of slices. The format is llama.cpp's docs/gguf.md, versions 2
and 3, little-endian (a big-endian file is refused by name).
"""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import gguf
import numpy as np

from models.errors import CheckpointError

_REQUIRED = object()
_STRING, _ARRAY = 8, 9  # GGUFValueType
# GGUFValueType -> the little-endian struct format of a scalar or array element of that type
_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALARS = {kind: struct.Struct("<" + code) for kind, code in _NUMBERS.items()}
_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # Hugging Face's order: the file's ggml dimensions reversed
    # The stored values (F32, F16) or bytes (every block type: [..., bytes a row]), memory-mapped:
    # what gguf.quants.dequantize takes.
    data: np.ndarray


class GGUFFile:
    """`metadata` (key -> a number, bool, string or list of them), `tensors` in the file's order."""

    def __init__(self, path: Path):
        self.path = path
        self._buffer = np.memmap(path, dtype=np.uint8, mode="r")
        self._view = memoryview(self._buffer)
        self._offset = 0
        magic = bytes(self._view[:4])
        if magic != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}); a checkpoint is a directory or a "
                                  ".gguf file")
        self._offset = 4
        version = self._number(4)
        if version not in (2, 3):
            swapped = "; a big-endian file is not supported" if version & 0xFFFF == 0 else ""
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are){swapped}")
        num_tensors, num_fields = self._number(10), self._number(10)
        self.metadata = {}
        for _ in range(num_fields):
            key = self._string()
            self.metadata[key] = self._value(self._number(4))
        infos = [(self._string(), [self._number(10) for _ in range(self._number(4))], self._number(4),
                  self._number(10)) for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def _number(self, kind: int):
        scalar = _SCALARS[kind]
        (value,) = scalar.unpack_from(self._view, self._offset)
        self._offset += scalar.size
        return value

    def _string(self) -> str:
        size = self._number(10)
        text = str(self._view[self._offset:self._offset + size], "utf-8")
        self._offset += size
        return text

    def _strings(self, count: int) -> list[str]:
        """`count` strings: the loop a vocabulary's hundreds of thousands of tokens run."""
        view, offset, size_of, strings = self._view, self._offset, _SCALARS[10].unpack_from, []
        for _ in range(count):
            (size,) = size_of(view, offset)
            strings.append(str(view[offset + 8:offset + 8 + size], "utf-8"))
            offset += 8 + size
        self._offset = offset
        return strings

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            return self._number(kind)
        element, count = self._number(4), self._number(10)
        if element == _STRING:
            return self._strings(count)
        if element == _ARRAY:
            return [self._value(self._number(4)) for _ in range(count)]
        dtype = np.dtype("<" + _NUMBERS[element])
        values = np.frombuffer(self._buffer, dtype, count, self._offset)
        self._offset += count * dtype.itemsize
        return values.tolist()

    def _tensor(self, name: str, dims: list[int], kind: int, offset: int) -> GGUFTensor:
        try:
            tensor_type = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise CheckpointError(f"{self.path}: tensor {name!r} has an unknown GGML type {kind}") from None
        shape = tuple(reversed(dims))
        if tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if tensor_type == gguf.GGMLQuantizationType.F32 else np.float16
            stored = shape
        else:  # blocks: each row's bytes
            dtype, stored = np.uint8, gguf.quant_shape_to_byte_shape(shape, tensor_type)
        count = int(np.prod(stored))
        if offset + count * np.dtype(dtype).itemsize > len(self._buffer):
            raise CheckpointError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        data = np.frombuffer(self._buffer, dtype, count, offset).reshape(stored)
        return GGUFTensor(name, tensor_type, shape, data)


def open_gguf(path) -> GGUFFile:
    """The file's metadata parsed and its tensors memory-mapped (read when dequantized)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(path)
    except CheckpointError:
        raise
    except (struct.error, ValueError, IndexError, KeyError, UnicodeDecodeError) as e:  # a cut or corrupt header
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def field(reader: GGUFFile, key: str, default=_REQUIRED):
    """A metadata value (a number, a string, a bool or a list of them), `default` when absent."""
    if key not in reader.metadata:
        if default is _REQUIRED:
            raise CheckpointError(f"{reader.path}: required metadata {key!r} is missing")
        return default
    return reader.metadata[key]
