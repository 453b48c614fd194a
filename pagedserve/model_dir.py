"""What the scheduler reads of its --model directory: end-of-sequence ids and the model's fingerprint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pagedserve.wire.fingerprint import model_fingerprint

log = logging.getLogger("pagedserve.scheduler")


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """Every end-of-sequence id the model declares, config.json's first.

    ``eos_token_id`` may be an int or a list in config.json and in
    generation_config.json (Llama 3.1 Instruct lists <|end_of_text|>, <|eom_id|> and
    <|eot_id|> there, and a chat turn ends with the last): generation stops at any.
    """
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
