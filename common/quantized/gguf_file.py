"""A GGUF file's tensor index, read without parsing its metadata values.

gguf's GGUFReader parses every metadata value into numpy views, one per token of the vocabulary (9 s for Qwen2.5
on a 2-core VM); the loader needs only the tensors. This reader steps over the values (a string array costs one
length read per item) and maps each tensor's bytes from the file as gguf lays them out
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): little-endian, version 2 or 3.
"""

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
# Metadata value types -> their size in bytes (8: string, 9: array are variable).
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands; the message says where."""


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: list[int]  # GGUF order: shape[0] is the row length (ne0)
    data: np.ndarray  # [rows, bytes per row] uint8 for block formats; the values for F32 / F16


class Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer, self.at = buffer, 0

    def take(self, fmt: str):
        try:
            values = struct.unpack_from("<" + fmt, self.buffer, self.at)
        except struct.error:
            raise GGUFFormatError(f"the file ends inside its header (at byte {self.at})") from None
        self.at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("Q")
        if self.at + length > len(self.buffer):
            raise GGUFFormatError(f"the file ends inside its header (a string at byte {self.at})")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def skip_value(self, value_type: int) -> None:
        if value_type in FIXED_SIZES:
            self.at += FIXED_SIZES[value_type]
        elif value_type == STRING:
            length = self.take("Q")  # read before the addition: `at += take()` would add to the old position
            self.at += length
        elif value_type == ARRAY:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in FIXED_SIZES:
                self.at += FIXED_SIZES[item_type] * count
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise GGUFFormatError(f"unknown metadata value type {value_type} at byte {self.at}")


def read_architecture(path: str) -> str:
    """The file's general.architecture, read from its header alone (the start-up check of a file's family)."""
    with open(path, "rb") as file:
        head = file.read(4)
    if head != MAGIC:
        raise GGUFFormatError("it does not start with the GGUF magic")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = Cursor(memoryview(mapped))
    cursor.at = 4
    version, _, kv_count = cursor.take("I"), cursor.take("Q"), cursor.take("Q")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (this reader knows 2 and 3)")
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.take("I")
        if key == "general.architecture" and value_type == STRING:
            return cursor.string()
        cursor.skip_value(value_type)
    raise GGUFFormatError("its header names no general.architecture")


def read_tensors(path: str) -> dict[str, GGUFTensor]:
    """The file's tensors by name, their bytes mapped read-only from the file."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = Cursor(memoryview(mapped))
    if bytes(mapped[:4]) != MAGIC:
        raise GGUFFormatError("it does not start with the GGUF magic")
    cursor.at = 4
    version, tensor_count, kv_count = cursor.take("I"), cursor.take("Q"), cursor.take("Q")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (this reader knows 2 and 3)")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.take("I")
        if key == "general.alignment" and value_type == UINT32:
            alignment = cursor.take("I")
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(tensor_count):
        name, dims = cursor.string(), cursor.take("I")
        shape = [cursor.take("Q") for _ in range(dims)]
        infos.append((name, cursor.take("I"), shape, cursor.take("Q")))
    start = -(-cursor.at // alignment) * alignment
    return {name: tensor(mapped, name, type_id, shape, start + offset) for name, type_id, shape, offset in infos}


def tensor(mapped: np.ndarray, name: str, type_id: int, shape: list[int], offset: int) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise GGUFFormatError(f"{name} has unknown block type {type_id}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    row_bytes = shape[0] // block_size * type_size
    end = offset + rows * row_bytes
    if end > len(mapped):
        raise GGUFFormatError(f"the file is truncated: {name} ends at byte {end}, the file at {len(mapped)}")
    raw = mapped[offset:end].reshape(rows, row_bytes)
    if qtype == GGMLQuantizationType.F32:
        data = raw.view(np.float32).reshape(*reversed(shape))
    elif qtype == GGMLQuantizationType.F16:
        data = raw.view(np.float16).reshape(*reversed(shape))
    else:
        data = raw
    return GGUFTensor(name, qtype, list(shape), data)
