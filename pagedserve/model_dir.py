"""What the scheduler reads of its --model: end-of-sequence ids, the model's fingerprint, the tokenizer.

``--model`` is an HF model directory or a GGUF file (``pagedserve/gguf_model.py``); the functions
here answer for both, so the services never ask which.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.wire.fingerprint import model_fingerprint

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pagedserve.gguf_model import GGUFModel

log = logging.getLogger("pagedserve.scheduler")


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """Every end-of-sequence id the model declares, config.json's first.

    ``eos_token_id`` may be an int or a list in config.json and in
    generation_config.json (Llama 3.1 Instruct lists <|end_of_text|>, <|eom_id|> and
    <|eot_id|> there, and a chat turn ends with the last): generation stops at any.
    """
    if is_gguf(model_dir):
        return open_gguf(model_dir).eos_token_ids
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0 and tok not in ids:
                ids.append(tok)
    return tuple(ids)


def served_model(model_dir: Path) -> str | None:
    """The fingerprint executors must present, when --model holds the weights (else the first
    executor's is taken, with a warning)."""
    try:
        return model_fingerprint(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("cannot fingerprint %s (%s): the first executor to register fixes the served model",
                    model_dir, exc)
        return None


def is_gguf(model: Path) -> bool:
    """Whether --model is a GGUF file (the gguf package is imported only then)."""
    if not model.is_file():
        return False
    from pagedserve.gguf_model import is_gguf as _is_gguf

    return _is_gguf(model)


def open_gguf(model: Path) -> GGUFModel:
    """The checked GGUF file, read once per process (tokenizer, template, eos ids all come from it)."""
    from pagedserve.gguf_model import open_gguf as _open

    return _open(model)


def load_tokenizer(model: Path) -> Tokenizer:
    """The model's tokenizer: tokenizer.json of a directory, or built from a GGUF's vocabulary.
    FileNotFoundError when a directory has none; GGUFError (a ValueError) for a bad file."""
    from tokenizers import Tokenizer

    if is_gguf(model):
        from pagedserve.gguf_tokenizer import build_tokenizer

        return build_tokenizer(open_gguf(model))
    path = model / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model} has no tokenizer.json (needed to tokenize prompts)")
    return Tokenizer.from_file(str(path))


def resolve_model(model: Path) -> Path:
    """--model as the services read it: a directory without config.json that holds exactly one
    ``.gguf`` file means that file (a volume mounted at a fixed path, as the Kubernetes manifests
    mount one, can then hold either kind). Anything else is returned as given."""
    if model.is_dir() and not (model / "config.json").is_file():
        files = sorted(p for p in model.glob("*.gguf") if p.is_file())
        if len(files) == 1:
            return files[0]
    return model


def has_model_config(model: Path) -> bool:
    """Whether --model is something a service can start from: a GGUF file or a directory with config.json."""
    return (model / "config.json").is_file() or is_gguf(model)


def max_positions(model: Path) -> int | None:
    """The longest sequence the model's config allows (config.json's ``max_position_embeddings``, a
    GGUF's context length): no executor's max_model_len is longer. None when it says nothing usable."""
    try:
        if is_gguf(model):
            value = open_gguf(model).config.get("max_position_embeddings")
        else:
            value = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
