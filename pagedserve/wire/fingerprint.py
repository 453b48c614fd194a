"""The model fingerprint of the handshake: which checkpoint an executor serves.

sha256 over ``config.json``'s bytes and every stored tensor's name, shape and
dtype, read from the safetensors headers only (no weights). Executors send it;
the scheduler computes the same from its own ``--model`` directory when the
weights are there and then admits only executors of that model, so the first
peer to register cannot decide what "the served model" is.

The header is read directly (8-byte little-endian length, then JSON, as the
safetensors format specifies) so the scheduler needs no tensor library.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors weights (pickle checkpoints are not loaded)")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: listed in the index but missing")
    return files


def checkpoint_manifest(model_dir: str | Path) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of every stored tensor, from the file headers only."""
    out = []
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"{path}: safetensors header of {size} bytes")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                out.append((name, list(entry["shape"]), entry["dtype"]))
    return sorted(out)


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json's bytes and the weights' names, shapes and dtypes; for a GGUF file,
    over its header (metadata and tensor table)."""
    if Path(model_dir).is_file():
        from pagedserve.gguf_model import open_gguf  # (gguf pulls numpy: only for GGUF models)

        return open_gguf(Path(model_dir)).fingerprint()
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for name, shape, dtype in checkpoint_manifest(model_dir):
        h.update(f"\n{name}:{shape}:{dtype}".encode())
    return h.hexdigest()
