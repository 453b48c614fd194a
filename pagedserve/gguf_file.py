"""The bytes of a GGUF file: its metadata, its tensor table, each tensor's stored blocks.

GGUF (llama.cpp's format, spec: ggml/docs/gguf.md): ``GGUF``, version, tensor and key counts,
the metadata key/values, one entry per tensor (name, dims innermost first, ggml type, offset),
then the aligned data section. The header is parsed here with ``struct`` rather than
``gguf.GGUFReader``, which builds a numpy view per string: 9 s for SmolLM2's 98k vocabulary
and merges strings, paid by every process that reads ``--model``; this takes a few tens of
milliseconds. Type sizes come from the ``gguf`` package (``GGML_QUANT_SIZES``), tensor data is a
read-only memory map, and dequantizing is left to ``gguf.quants`` (executor side).

Every offset is checked against the file's size before anything is returned, so a truncated
file fails here, at start, naming the tensor that runs past the end.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 24  # keys, tensors, array items, dims: far beyond any real file, bounds a corrupt count

# GGUF metadata value types -> struct format (8 string, 9 array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF this server can read: truncated, corrupt, or describing something else."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch/numpy order, outermost first (GGUF stores dims innermost first)
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the data section
    nbytes: int


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header (needs {n} bytes at offset {self.pos}, "
                            f"file has {len(self.buf)})")
        out = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.take(size))[0]

    def count(self, what: str) -> int:
        n = self.scalar("Q")
        if n > MAX_COUNT:
            raise GGUFError(f"{self.path}: {what} count {n} at offset {self.pos - 8} is not plausible (corrupt file?)")
        return n

    def string(self) -> str:
        n = self.scalar("Q")
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: a string at offset {self.pos - n} is not UTF-8") from e

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("I"), self.count("array item")
            if itype == _STRING:
                return [self.string() for _ in range(n)]
            if itype not in _NUMPY:
                raise GGUFError(f"{self.path}: array of unknown value type {itype} at offset {self.pos}")
            dtype = np.dtype(_NUMPY[itype]).newbyteorder("<")
            return np.frombuffer(self.take(n * dtype.itemsize), dtype=dtype).tolist()
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at offset {self.pos}")
        return self.scalar(_SCALARS[vtype])


class GGUFFile:
    """One GGUF file, opened read-only: ``metadata`` (key -> Python value), ``tensors`` (name ->
    :class:`TensorInfo`), ``header_bytes`` (everything before the data: what the fingerprint hashes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < 24:
                    raise GGUFError(f"{self.path}: {size} bytes is too short for a GGUF file")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot read ({e.strerror or e})") from e
        cur = _Cursor(self._map, self.path)
        if bytes(cur.take(4)) != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (no 'GGUF' magic; big-endian files are not read)")
        self.version = cur.scalar("I")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (supported: "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors, n_keys = cur.count("tensor"), cur.count("metadata key")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_keys):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"))
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment {align!r} is not a power of two")
        self.data_start = -(-cur.pos // align) * align
        self.header_bytes = bytes(self._map[:cur.pos])
        self.tensors: dict[str, TensorInfo] = {}
        for info in infos:
            end = self.data_start + info.offset + info.nbytes
            if end > size:
                raise GGUFError(f"{self.path}: truncated: tensor {info.name} ends at byte {end}, the file has {size}")
            if info.name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {info.name} is listed twice")
            self.tensors[info.name] = info

    def _tensor_info(self, cur: _Cursor) -> TensorInfo:
        name = cur.string()
        n_dims = cur.scalar("I")
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"{self.path}: tensor {name} has {n_dims} dimensions (GGUF allows 1 to 4)")
        dims = [cur.scalar("Q") for _ in range(n_dims)]
        raw_type = cur.scalar("I")
        offset = cur.scalar("Q")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        elements = int(np.prod(dims))
        if dims[0] % block:
            raise GGUFError(f"{self.path}: tensor {name}: rows of {dims[0]} are not whole {ggml_type.name} "
                            f"blocks of {block}")
        return TensorInfo(name, tuple(reversed(dims)), ggml_type, offset, elements // block * type_size)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor, read-only, as ``gguf.quants.dequantize`` takes them:
        uint8 rows for block formats, the plain dtype (F32, F16) otherwise."""
        info = self.tensors[name]
        start = self.data_start + info.offset
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=start)
        plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(info.ggml_type)
        if plain is not None:
            return data.view(plain).reshape(info.shape)
        return data.reshape(*info.shape[:-1], -1)
