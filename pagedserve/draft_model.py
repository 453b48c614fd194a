"""A draft model for speculative decoding, checked against the served model without torch.

Both services check it at start (``--speculative-config '{"model": DIR, ...}'`` on the scheduler,
``--speculative-model DIR`` on the executor): a draft proposes token ids that the target model
verifies, so the two must mean the same thing by every id. The vocabulary sizes must be equal and,
where both have a tokenizer (tokenizer.json, or a GGUF's vocabulary), the token -> id maps too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedserve.model_dir import has_model_config, is_gguf, load_tokenizer, open_gguf, resolve_model


@dataclass(frozen=True, slots=True)
class DraftInfo:
    path: Path  # as resolved (a directory holding one .gguf file means that file)
    name: str  # what the executor's handshake calls it (Handshake.draft_model)
    vocab_size: int


def draft_name(path: Path) -> str:
    """The name both sides give a draft: its directory's (or file's) name."""
    return resolve_model(path).resolve().name


def vocab_size(model: Path) -> int:
    if is_gguf(model):
        return int(open_gguf(model).config["vocab_size"])
    value = json.loads((model / "config.json").read_text()).get("vocab_size")
    if type(value) is not int or value <= 0:
        raise ValueError(f"{model}/config.json: no usable vocab_size ({value!r})")
    return value


def _vocab(model: Path) -> dict[str, int] | None:
    try:
        return load_tokenizer(model).get_vocab(with_added_tokens=True)
    except FileNotFoundError:
        return None


def check_draft(draft: Path, target: Path) -> DraftInfo:
    """The draft's facts; ValueError naming the draft when it cannot serve ``target``."""
    path = resolve_model(Path(draft))
    if not has_model_config(path):
        raise ValueError(f"draft model {draft}: no config.json (nor is it a GGUF file, or a directory holding one)")
    target = resolve_model(Path(target))
    try:
        ours, theirs = vocab_size(path), vocab_size(target)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"draft model {draft}: {exc}") from None
    if ours != theirs:
        raise ValueError(f"draft model {draft}: a vocabulary of {ours} tokens, the served model {target.name} has "
                         f"{theirs}; a draft must share the model's tokenizer")
    a, b = _vocab(path), _vocab(target)
    if a is not None and b is not None and a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))[:1]
        raise ValueError(f"draft model {draft}: its tokenizer differs from the served model {target.name}'s "
                         f"(e.g. {diff[0][0]!r}); a draft must share the model's tokenizer")
    return DraftInfo(path, path.resolve().name, ours)
