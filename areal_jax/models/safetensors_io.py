"""Minimal safetensors reader/writer on NumPy memory maps.

Why not the `safetensors` package: its NumPy backend has no bfloat16, and we want lazy views
so that each device reads only the slice it holds. The format is small: an 8-byte little-endian
header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes.
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy access to the tensors of one .safetensors file."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries: dict[str, dict] = header
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=8 + n) if header else None

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype_name(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def view(self, name: str) -> np.ndarray:
        """A read-only lazy view of tensor `name` (bytes are read only when sliced and copied)."""
        entry = self.entries[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']} "
                             f"(supported: {', '.join(DTYPES)})")
        start, end = entry["data_offsets"]
        return self._data[start:end].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write_safetensors(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` to `path` atomically (a temporary file renamed into place)."""
    path = pathlib.Path(path)
    header: dict[str, dict] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {arr.dtype} (supported: {list(_NAMES)})")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        arrays[name] = arr
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays.values():
            f.write(arr.tobytes())
    tmp.replace(path)
