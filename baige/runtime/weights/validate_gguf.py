"""Check a GGUF file's structure before the ``gguf`` package reads it.

The layout (spec: ggml ``docs/gguf.md``): magic ``GGUF``, a uint32 version, uint64 tensor and key-value
counts, the key-value pairs (a string key, a uint32 value type, the value; strings are a uint64 length
then UTF-8 bytes; arrays a uint32 element type, a uint64 count, the elements), the tensor infos (name,
uint32 dimension count, uint64 dimensions innermost first, uint32 ggml type, uint64 offset), padding to
``general.alignment`` (default 32), then the tensor data. Everything is little-endian here.

:func:`check_gguf` walks all of it over a memory map, bounding every count and length by the bytes
left in the file before using it, so a lying length fails in one line instead of an ``IndexError``
or a huge allocation inside ``gguf.GGUFReader``; and it checks the tensors' types are known, their
byte sizes follow from shape and type, and their data lies inside the file without overlapping.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from baige.errors import BaigeError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # those gguf-py reads (READER_SUPPORTED_VERSIONS)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 64  # GGML_MAX_NAME: tensor names
MAX_ARRAY_NESTING = 4
# GGUF value type -> struct format of one element (STRING=8 and ARRAY=9 are variable-sized)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor as the file declares it: ``shape`` innermost first (GGUF's order), ggml type id,
    element count, bytes in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    numel: int
    nbytes: int


@dataclass(frozen=True)
class GGUFSummary:
    version: int
    keys: tuple[str, ...]
    tensors: tuple[GGUFTensor, ...]


class _Cursor:
    """Reads little-endian values from a buffer; every read checks the bytes left first."""

    def __init__(self, buf: mmap.mmap | bytes | bytearray | memoryview):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def left(self) -> int:
        return self.size - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise BaigeError(f"{what} at byte {self.pos} declares {n} bytes, past the end of the {self.size}-byte file")
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        self.skip(n, what)
        return bytes(self.buf[self.pos - n : self.pos])

    def strings(self, n: int, what: str) -> None:
        """Step over ``n`` strings, each checked to lie inside the file and to be UTF-8 (one tight loop:
        tokenizer vocabularies hold ~10**5 of them)."""
        buf, pos, size = self.buf, self.pos, self.size
        for _ in range(n):
            if pos + 8 > size:
                raise BaigeError(f"{what} at byte {pos} runs past the end of the {size}-byte file")
            (length,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
            if length > size - pos:
                raise BaigeError(f"{what} at byte {pos - 8} declares {length} bytes, past the end of the file")
            try:
                bytes(buf[pos : pos + length]).decode("utf-8")
            except UnicodeDecodeError:
                raise BaigeError(f"{what} at byte {pos} is not UTF-8") from None
            pos += length
        self.pos = pos

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, min_item_bytes: int, what: str) -> int:
        """A uint64 count of items of at least ``min_item_bytes`` each, bounded by the bytes left."""
        n = self.unpack("<Q", what)
        if n * min_item_bytes > self.left():
            raise BaigeError(f"{what} {n} at byte {self.pos - 8} cannot fit in the {self.left()} bytes left")
        return n

    def string(self, what: str) -> str:
        n = self.count(1, f"{what} length")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise BaigeError(f"{what} at byte {self.pos - n} is not UTF-8") from None


def _skip_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> object:
    """Check (and step over) one value of type ``vtype``; returns scalars (for ``general.alignment``)."""
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype], f"the value of {key!r}")
    if vtype == STRING:
        return cur.string(f"the string value of {key!r}")
    if vtype != ARRAY:
        raise BaigeError(f"key {key!r} has unknown value type {vtype}")
    if depth >= MAX_ARRAY_NESTING:
        raise BaigeError(f"key {key!r}: arrays nested more than {MAX_ARRAY_NESTING} deep")
    etype = cur.unpack("<I", f"the array type of {key!r}")
    if etype in _SCALARS:
        size = struct.calcsize(_SCALARS[etype])
        n = cur.count(size, f"the array count of {key!r}")
        cur.skip(n * size, f"the array of {key!r}")
    elif etype == STRING:
        cur.strings(cur.count(8, f"the array count of {key!r}"), f"a string in the array {key!r}")
    elif etype == ARRAY:
        for _ in range(cur.count(12, f"the array count of {key!r}")):
            _skip_value(cur, ARRAY, key, depth + 1)
    else:
        raise BaigeError(f"key {key!r} is an array of unknown type {etype}")
    return None


def _tensor_info(cur: _Cursor, alignment: int, names: set[str]) -> tuple[GGUFTensor, int]:
    """One tensor info checked: a short unique name, 1..4 dims, a known type dividing the innermost
    dim into whole blocks, an aligned offset. Returns (tensor, offset into the data)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = cur.string("a tensor name")
    if len(name.encode()) > MAX_NAME_BYTES or name in names:
        raise BaigeError(f"tensor name {name[:80]!r} is longer than 64 bytes or repeated")
    names.add(name)
    n_dims = cur.unpack("<I", f"the dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise BaigeError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    shape = tuple(cur.unpack("<Q", f"a dimension of {name!r}") for _ in range(n_dims))
    ggml_type = cur.unpack("<I", f"the type of {name!r}")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise BaigeError(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
    if shape[0] % block:
        raise BaigeError(f"tensor {name!r}: innermost dimension {shape[0]} is not a multiple of its block {block}")
    offset = cur.unpack("<Q", f"the offset of {name!r}")
    if offset % alignment:
        raise BaigeError(f"tensor {name!r}: offset {offset} is not a multiple of the alignment {alignment}")
    numel = 1
    for d in shape:
        numel *= d
    return GGUFTensor(name, shape, ggml_type, numel, numel // block * type_size), offset


def parse_gguf(buf: mmap.mmap | bytes | bytearray | memoryview) -> GGUFSummary:
    """Check the GGUF structure held in ``buf`` (a file's bytes). Raises BaigeError (without a path)."""
    cur = _Cursor(buf)
    if cur.size < 4 or cur.take(4, "the magic") != MAGIC:
        raise BaigeError("not a GGUF file (no GGUF magic)")
    version = cur.unpack("<I", "the version")
    if version not in VERSIONS:
        raise BaigeError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    n_tensors = cur.count(8 + 4 + 8 + 4 + 8, "the tensor count")
    n_kv = cur.count(8 + 4 + 1, "the key-value count")
    keys, alignment = [], 32
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        if key in keys:
            raise BaigeError(f"metadata key {key[:80]!r} is repeated")
        keys.append(key)
        vtype = cur.unpack("<I", f"the value type of {key!r}")
        value = _skip_value(cur, vtype, key)
        if key == "general.alignment":
            if vtype != 4 or not value or value & (value - 1):
                raise BaigeError(f"general.alignment must be a uint32 power of two, got {value!r}")
            alignment = value
    names: set[str] = set()
    infos = [_tensor_info(cur, alignment, names) for _ in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    data_len = cur.size - data_start
    end = 0
    for t, offset in sorted(infos, key=lambda x: x[1]):
        if offset < end:
            raise BaigeError(f"tensor {t.name!r}: data at offset {offset} overlaps the tensor before it")
        end = offset + t.nbytes
        if end > data_len:
            raise BaigeError(
                f"tensor {t.name!r}: {t.nbytes} bytes at offset {offset} run past the file's "
                f"{max(data_len, 0)} data bytes"
            )
    return GGUFSummary(version, tuple(keys), tuple(t for t, _ in infos))


def check_gguf(path: str | Path) -> GGUFSummary:
    """Check the structure of the GGUF file at ``path`` (see the module docstring); reads no tensor data.

    Raises:
        BaigeError: naming ``path``: not GGUF, an unsupported version, a count, length or offset past
        the end of the file, an unknown value or tensor type, a repeated key or tensor name, a bad
        alignment, tensor data outside the file or overlapping.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if path.stat().st_size == 0:
                raise BaigeError("not a GGUF file (empty)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return parse_gguf(buf)
    except OSError as e:
        raise BaigeError(f"{path}: cannot read ({e.strerror or e})") from None
    except BaigeError as e:
        raise BaigeError(f"{path}: not a valid GGUF file: {e}") from None
