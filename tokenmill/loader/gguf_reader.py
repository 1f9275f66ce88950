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
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from tokenmill.checks import short_repr


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


GGML_MAX_DIMS = 4  # llama.cpp's limit on a tensor's dimensions
MAX_ARRAY_DEPTH = 2  # an array of arrays is allowed (merges in old files), no deeper
MAX_ALIGNMENT = 1 << 20
# The fewest bytes one item can take in the file; a count is checked against the bytes
# left before anything is allocated for it (a flipped count must not cost a gigabyte).
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, one byte of value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


def _label(name: str) -> str:
    """A tensor name or key for a one-line error: as is when short and printable, else its repr
    cut short (a corrupt length can swallow kilobytes of the header, newlines included)."""
    return name if name.isprintable() and len(name) <= 80 else short_repr(name)


_MIN_ARRAY_BYTES = 4 + 8  # element type, count


def _error(path, problem: str) -> GGUFFormatError:
    return GGUFFormatError(f"{path}: {problem}")


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing as it goes. Every read
    checks the bytes it needs are there: a truncated or lying file raises GGUFFormatError
    naming what was being read, before any allocation sized from the file."""

    def __init__(self, buf: mmap.mmap, path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, problem: str) -> GGUFFormatError:
        return _error(self.path, problem)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(
                f"truncated or corrupt GGUF header: {what} needs {n} bytes at offset "
                f"{self.pos}, the file has {len(self.buf)}"
            )

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """A count read from the file, checked against the bytes left to hold its items."""
        left = len(self.buf) - self.pos
        if n * min_bytes > left:
            raise self.fail(
                f"corrupt GGUF header: {what} is {n}, but only {left} bytes are left "
                f"(each takes at least {min_bytes})"
            )
        return n

    def u32(self) -> int:
        self.need(4, "a u32")
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        self.need(8, "a u64")
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        size = self.u64()
        self.need(size, "a string")
        text = self.buf[self.pos : self.pos + size].decode("utf-8", errors="replace")
        self.pos += size
        return text

    def value(self, vtype: int, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array(self.u32(), self.u64(), key, depth=1)
        fmt = struct.Struct(self.scalar_format(vtype, key))
        self.need(fmt.size, f"the value of {key}")
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def scalar_format(self, vtype: int, key: str) -> str:
        try:
            return _SCALAR_FORMATS[GGUFValueType(vtype)]
        except (ValueError, KeyError):
            raise self.fail(
                f"corrupt GGUF header: {_label(key)} has unknown value type {vtype}"
            ) from None

    def array(self, vtype: int, count: int, key: str, depth: int) -> np.ndarray | list:
        if vtype == GGUFValueType.STRING:
            return self.strings(self.count(count, 8, f"the length of array {key}"))
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"corrupt GGUF header: {_label(key)} nests arrays too deeply")
            count = self.count(count, _MIN_ARRAY_BYTES, f"the length of array {key}")
            return [self.array(self.u32(), self.u64(), key, depth + 1) for _ in range(count)]
        dtype = np.dtype(self.scalar_format(vtype, key).replace("?", "b1"))
        count = self.count(count, dtype.itemsize, f"the length of array {key}")
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += dtype.itemsize * count
        return values

    def strings(self, count: int) -> list[str]:
        buf, pos, unpack, end = self.buf, self.pos, _U64.unpack_from, len(self.buf)
        out = []
        for _ in range(count):
            if pos + 8 > end:
                break
            (size,) = unpack(buf, pos)
            if pos + 8 + size > end:
                break
            out.append(buf[pos + 8 : pos + 8 + size].decode("utf-8", errors="replace"))
            pos += 8 + size
        self.pos = pos
        if len(out) < count:
            self.need(8, f"string {len(out)} of {count} in an array")  # raises
        return out


# The last header parsed, by the file's identity (device, inode, size, mtime): loading
# reads a file's header twice (the weights' loader, then the tokenizer), and a 128k-piece
# vocabulary with its merges takes a few hundred ms each time. Holds one file's metadata,
# which the loaded model keeps anyway.
_last_header: tuple[tuple, int, int, dict[str, Any]] | None = None


def _identity(buf: mmap.mmap, path) -> tuple | None:
    try:
        st = Path(path).stat()
    except (OSError, TypeError, ValueError):
        return None
    if st.st_size != len(buf):  # not the file mapped (replaced since)
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _header(cur: _Cursor) -> tuple[int, dict[str, Any]]:
    """The tensor count and the key/values, the cursor left after them. A copy of the
    dict each time: callers may add keys; the values (lists, arrays) are shared, read-only
    by convention."""
    global _last_header
    key = _identity(cur.buf, cur.path)
    if key is not None and _last_header is not None and _last_header[0] == key:
        _, cur.pos, n_tensors, metadata = _last_header
        return n_tensors, dict(metadata)
    n_tensors, metadata = _parse_header(cur)
    if key is not None:
        _last_header = (key, cur.pos, n_tensors, metadata)
    return n_tensors, dict(metadata)


def _parse_header(cur: _Cursor) -> tuple[int, dict[str, Any]]:
    if cur.buf[:4] != b"GGUF":
        raise cur.fail("not a GGUF file")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version} (or big-endian file)")
    n_tensors = cur.u64()
    n_kv = cur.count(cur.u64(), _MIN_KV_BYTES, "the key/value count")
    cur.count(n_tensors, _MIN_TENSOR_INFO_BYTES, "the tensor count")  # checked again later
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise cur.fail(f"corrupt GGUF header: key {_label(key)} appears twice")
        metadata[key] = cur.value(cur.u32(), key)
    return n_tensors, metadata


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value pair of a GGUF file's header (not the tensor infos, not the tensors)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _header(_Cursor(buf, path))[1]
        except (struct.error, UnicodeDecodeError, KeyError, ValueError, OverflowError) as e:
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
        except (struct.error, UnicodeDecodeError, KeyError, ValueError, OverflowError) as e:
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

    def release_view(self, view: np.ndarray) -> None:
        """Drop the whole pages under `view` (a contiguous array) from the resident set, if
        it lies in this file's mapping; any other memory is left alone (its pages are not
        the file's to drop: DONTNEED would zero anonymous memory)."""
        if not hasattr(mmap, "MADV_DONTNEED") or view.size == 0 or not view.flags.c_contiguous:
            return
        base = np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        off = view.ctypes.data - base
        if off < 0 or off + view.nbytes > len(self._map):
            return
        page = mmap.PAGESIZE
        start, end = -(-off // page) * page, (off + view.nbytes) // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _parse(self) -> None:
        cur = _Cursor(self._map, self.path)
        n_tensors, self.metadata = _header(cur)
        n_tensors = cur.count(n_tensors, _MIN_TENSOR_INFO_BYTES, "the tensor count")
        infos, names = [], set()
        for _ in range(n_tensors):
            name = cur.string()
            if name in names:
                raise cur.fail(f"corrupt GGUF header: tensor {_label(name)} appears twice")
            names.add(name)
            n_dims = cur.u32()
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise cur.fail(f"tensor {_label(name)}: {n_dims} dimensions (1 to {GGML_MAX_DIMS})")
            dims = [cur.u64() for _ in range(n_dims)]
            raw_type = cur.u32()
            try:
                qtype = GGMLQuantizationType(raw_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise cur.fail(f"tensor {_label(name)}: unknown ggml type {raw_type}") from None
            infos.append((name, dims, qtype, cur.u64()))
        align = self.metadata.get("general.alignment", 32)
        if not (isinstance(align, int) and 0 < align <= MAX_ALIGNMENT and align & (align - 1) == 0):
            raise cur.fail(f"general.alignment must be a power of two, got {align!r:.40}")
        start = -(-cur.pos // align) * align
        size = len(self._map)
        self.tensors = []
        for name, dims, qtype, offset in infos:
            self.tensors.append(self._tensor(name, dims, qtype, offset, start, size, align))

    def _tensor(self, name, dims, qtype, offset, start, size, align) -> GGUFTensor:
        """One tensor's info checked against the file (llama.cpp's checks), and its view."""

        def fail(problem: str) -> GGUFFormatError:
            return _error(self.path, problem)

        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(d < 1 for d in dims) or dims[0] % block:
            raise fail(
                f"tensor {_label(name)}: dimensions {dims} (each >= 1, the first a multiple of {block})"
            )
        n_elements = 1
        for d in dims:
            n_elements *= d  # Python ints: a flipped dimension cannot overflow
        n_bytes = n_elements // block * type_size
        if offset % align:
            raise fail(f"tensor {_label(name)}: offset {offset} is not a multiple of the alignment")
        begin = start + offset
        if begin + n_bytes > size:
            raise fail(
                f"truncated: tensor {_label(name)} ({n_bytes} bytes at {begin}) ends past the end "
                f"of the file ({size} bytes)"
            )
        shape = tuple(int(d) for d in reversed(dims))
        if qtype == GGMLQuantizationType.F32:
            data = np.frombuffer(self._map, np.float32, n_elements, begin).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = np.frombuffer(self._map, np.float16, n_elements, begin).reshape(shape)
        else:
            raw = np.frombuffer(self._map, np.uint8, n_bytes, begin)
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        return GGUFTensor(name, shape, qtype, begin, n_bytes, data)


_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFShards:
    """A model split over several GGUF files (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf,
    each with its own header and a share of the tensors), read as one: the first file's
    metadata (less the split.* keys) and every file's tensors, each still mapped from its
    own file."""

    def __init__(self, files: list[GGUFFile]):
        self.files = files
        self.path = files[0].path
        self.metadata = {k: v for k, v in files[0].metadata.items() if not k.startswith("split.")}
        self.tensors = [t for f in files for t in f.tensors]
        self._owner = {id(t): f for f in files for t in f.tensors}
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise _error(self.path, f"tensor {_label(dup)} appears in two parts of the split model")

    def release(self, tensor: GGUFTensor) -> None:
        self._owner[id(tensor)].release(tensor)

    def release_view(self, view: np.ndarray) -> None:
        for f in self.files:  # each drops pages only where the view lies in its mapping
            f.release_view(view)


def open_gguf_file(path: str | Path) -> GGUFFile | GGUFShards:
    """A GGUF file, or every part of a split model given its first part (the others are
    found beside it by llama.cpp's naming; split.count in the header says how many)."""
    first = GGUFFile(path)
    count = first.metadata.get("split.count", 1)
    if not isinstance(count, int) or count <= 1:
        return first
    match = _SPLIT_NAME.match(first.path.name)
    if match is None or int(match["no"]) != 1 or int(match["count"]) != count:
        raise _error(
            first.path,
            f"split.count is {count}: open the first part, named NAME-00001-of-{count:05d}.gguf",
        )
    files = [first]
    for no in range(2, count + 1):
        part = first.path.with_name(f"{match['stem']}-{no:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise _error(first.path, f"part {no} of {count} is missing: {part.name}")
        files.append(GGUFFile(part))
    return GGUFShards(files)
