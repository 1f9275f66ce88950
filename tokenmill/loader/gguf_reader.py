"""A small, fast GGUF reader: header key/values, tensor infos, and memory-mapped tensor data.

`gguf.GGUFReader` builds a numpy view per metadata array element, which takes 8-15 s
and ~150 MB for Gemma's 262k-piece vocabulary. This reader parses the key/value section
itself (numeric arrays in one `numpy.frombuffer` each, string arrays in a tight loop) and
maps the tensor data section without copying; the `gguf` package still provides the
type tables and the block dequantizers.

Layout (little-endian): magic "GGUF", version u32, tensor count u64, kv count u64, the
key/values, then per tensor: name, n_dims u32, dims u64 x n_dims (fastest first), ggml
type u32, offset u64 (from the start of the data section); the data section begins at
the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file."""


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing as it goes."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        size = self.u64()
        text = self.buf[self.pos : self.pos + size].decode("utf-8", errors="replace")
        self.pos += size
        return text

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array(self.u32(), self.u64())
        fmt = struct.Struct(_SCALAR_FORMATS[GGUFValueType(vtype)])
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def array(self, vtype: int, count: int) -> np.ndarray | list:
        if vtype == GGUFValueType.STRING:
            return self.strings(count)
        if vtype == GGUFValueType.ARRAY:
            return [self.array(self.u32(), self.u64()) for _ in range(count)]
        dtype = np.dtype(_SCALAR_FORMATS[GGUFValueType(vtype)].replace("?", "b1"))
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += dtype.itemsize * count
        return values

    def strings(self, count: int) -> list[str]:
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out = []
        for _ in range(count):
            (size,) = unpack(buf, pos)
            out.append(buf[pos + 8 : pos + 8 + size].decode("utf-8", errors="replace"))
            pos += 8 + size
        self.pos = pos
        return out


def _header(cur: _Cursor, path) -> tuple[int, dict[str, Any]]:
    if cur.buf[:4] != b"GGUF":
        raise GGUFFormatError(f"{path}: not a GGUF file")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: unsupported GGUF version {version} (or big-endian file)")
    n_tensors = cur.u64()
    n_kv = cur.u64()
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.u32())
    return n_tensors, metadata


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value pair of a GGUF file's header (not the tensor infos, not the tensors)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _header(_Cursor(buf), path)[1]
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as e:
            if isinstance(e, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from None


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): [rows, cols] for a matrix
    tensor_type: GGMLQuantizationType
    data_offset: int  # absolute, in the file
    n_bytes: int
    data: np.ndarray  # a view of the mapped file: float32/float16, or uint8 [rows, row_bytes]


class GGUFFile:
    """A GGUF file mapped read-only: `metadata` (dict) and `tensors` (list of GGUFTensor)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as e:
            if isinstance(e, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{self.path}: truncated or corrupt GGUF file ({e})") from None

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the pages of a tensor's bytes from this process's resident set (the data
        stays readable: touching it again faults the pages back in from the file)."""
        page = mmap.PAGESIZE
        start = tensor.data_offset // page * page
        end = min(len(self._map), tensor.data_offset + tensor.n_bytes)
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _parse(self) -> None:
        cur = _Cursor(self._map)
        n_tensors, self.metadata = _header(cur, self.path)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.u64() for _ in range(cur.u32())]
            infos.append((name, dims, GGMLQuantizationType(cur.u32()), cur.u64()))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        size = len(self._map)
        self.tensors = []
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims)) if dims else 1
            n_bytes = n_elements // block * type_size
            begin = start + offset
            shape = tuple(int(d) for d in reversed(dims))
            if begin + n_bytes > size:
                data = np.zeros(0, dtype=np.uint8)  # truncated: the loader reports it
            elif qtype == GGMLQuantizationType.F32:
                data = np.frombuffer(self._map, np.float32, n_elements, begin).reshape(shape)
            elif qtype == GGMLQuantizationType.F16:
                data = np.frombuffer(self._map, np.float16, n_elements, begin).reshape(shape)
            else:
                raw = np.frombuffer(self._map, np.uint8, n_bytes, begin)
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, shape, qtype, begin, n_bytes, data))
