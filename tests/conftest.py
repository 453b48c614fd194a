"""Shared fixtures: tiny HF checkpoints built locally (no downloads), once per session.

- ``tiny_checkpoint(arch="llama", size="small", **overrides) -> Path``: factory, cached per
  arguments; overrides are ``build_tiny_model`` keywords (tie_word_embeddings,
  rope_parameters, max_shard_size, seed, num_key_value_heads); sizes are ``executor_svc.tiny_model.SIZES``
  (``tp``: 8 q / 4 KV heads, for tensor parallelism).
- ``tiny_llama_dir``: small Llama, GQA (4 heads / 2 KV heads), untied embeddings.
- ``tiny_qwen2_dir``: small Qwen2, q/k/v bias, tied embeddings.
- ``tiny_mistral_dir``: small Mistral, untied.
- ``tiny_llama_default_dir``: the default-size Llama (~30M params, ~125 MB on disk; slower).
- ``tiny_gguf(arch="llama", qtype="Q4_1") -> Path``: factory of small GGUF files with every matrix
  in one ggml type (``testing.gguf_files.write_gguf``, hidden 64 as the small checkpoints;
  qwen2 tied), for the tests that run every CPU weight format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    from executor_svc.tiny_model import build_tiny_model

    cache: dict[str, Path] = {}

    def make(arch: str = "llama", size: str = "small", **overrides) -> Path:
        key = json.dumps([arch, size, overrides], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{size}")
            cache[key] = build_tiny_model(out, arch, size, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", "small")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2", "small")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("mistral", "small")


@pytest.fixture(scope="session")
def tiny_llama_default_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", "default")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_llama_dir) -> Callable[..., Path]:
    from gguf import GGMLQuantizationType

    from testing.gguf_files import write_gguf

    cache: dict[tuple[str, str], Path] = {}

    def make(arch: str = "llama", qtype: str = "Q4_1") -> Path:
        if (arch, qtype) not in cache:
            out = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}") / f"m-{qtype}.gguf"
            cache[arch, qtype] = write_gguf(out, tiny_llama_dir, arch, GGMLQuantizationType[qtype],
                                            tied=arch == "qwen2", sizes=dict(hidden=64, intermediate=160))
        return cache[arch, qtype]

    return make
