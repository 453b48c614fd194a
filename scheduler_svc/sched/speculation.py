"""Speculative decoding: the ``--speculative-config`` knob, the n-gram (prompt lookup) proposer and
the draft model's stand-in.

N-gram proposals are made here, in the scheduler, because it already holds every sequence's prompt
and output tokens: a lookup costs microseconds and needs no model, so making it where the tokens
live keeps the executor stateless about speculation (the plan carries the proposals, and the
executor only scores them). A draft model needs weights, so its proposals are made in the executor
(``executor_svc/speculative/draft.py``); the scheduler only decides who proposes and how many
(:class:`DraftProposer`), and reserves their slots exactly as for n-gram proposals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from scheduler_svc.sched.speculation_policy import DEFAULT_MAX_VERIFIED_TOKENS

SPECULATIVE_METHODS = ("ngram", "draft_model")
MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS = 1, 16
MAX_PROMPT_LOOKUP = 64  # longer n-grams cost lookup time and almost never match better
_NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_verified_tokens")
_DRAFT_KEYS = ("method", "model", "num_speculative_tokens", "max_verified_tokens")
MAX_VERIFIED_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` fields that pagedserve understands: the n-gram method, or a
    draft model (``model``: its directory, which every executor loads with --speculative-model)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model (method "draft_model")
    # pagedserve's: positions a step verifies at most, its sequences' own and their proposals
    # (speculation_policy.py); a batch of this many sequences does not speculate.
    max_verified_tokens: int = DEFAULT_MAX_VERIFIED_TOKENS

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method: must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"model: the draft_model method needs a draft model directory, and only it takes one "
                             f"(method {self.method!r}, model {self.model!r})")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model: must be a directory path, got {self.model!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens,
                MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, MAX_PROMPT_LOOKUP)
        _int_in("max_verified_tokens", self.max_verified_tokens, 2, MAX_VERIFIED_TOKENS)


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in {low}..{high}, got {value!r}")


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The flag's JSON object -> a validated config; ValueError names the field and its limit."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a JSON object: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    if "model" in raw and raw.setdefault("method", "draft_model") == "draft_model":  # (vLLM infers the method)
        known = _DRAFT_KEYS
    else:
        known = _NGRAM_KEYS
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} for method {raw.get('method', 'ngram')!r}; known: {list(known)}")
    # vLLM: when only one lookup bound is given, the other equals it (checked first: a bad value is
    # named as the field the user wrote, not as the one it was copied to)
    for given, other in (("prompt_lookup_min", "prompt_lookup_max"), ("prompt_lookup_max", "prompt_lookup_min")):
        if given in raw and other not in raw:
            _int_in(given, raw[given], 1, MAX_PROMPT_LOOKUP)
            raw[other] = raw[given]
    return SpeculativeConfig(**raw)


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in it, propose what followed.

    Tries the longest n first (``prompt_lookup_max`` down to ``prompt_lookup_min``) and, for one n,
    the most recent earlier occurrence: in an edit the text being copied is the latest match.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to ``k`` (default the configured k) proposed next tokens; [] when nothing matches.

        One pass over the sequence finds the earlier positions holding its last token; each further
        suffix token keeps those that still match one position back. So the cost is one comparison
        of the whole sequence plus work on the candidates, not one per n: with asynchronous
        scheduling this runs for nearly every decoding sequence on every step (``waits``), where a
        scan per n cost milliseconds per sequence at 32K tokens."""
        k = self.k if k is None else k
        seq = np.asarray(tokens, dtype=np.int64) if isinstance(tokens, list) else tokens
        last = len(seq) - 1
        if last < 1:
            return []
        alive = np.flatnonzero(seq[:last] == seq[last])  # where earlier n-grams end, matched n = 1
        if not len(alive):
            return []
        matched = 1
        while matched < self.max_n:
            longer = alive[alive >= matched]  # (those with a token one further back)
            longer = longer[seq[longer - matched] == seq[last - matched]]
            if not len(longer):
                break
            alive, matched = longer, matched + 1
        if matched < self.min_n:
            return []
        start = int(alive[-1]) + 1  # the most recent of the longest matches
        return seq[start:start + k].tolist()


class TokenMirror:
    """Each sequence's tokens as an int32 array for the n-gram lookup, grown by what was appended
    since its last look: converting a 32K-token list anew cost half a millisecond per sequence per
    step. A sequence's tokens only grow (its id is never reused), so a mirror stays valid; one whose
    last mirrored token differs is rebuilt all the same."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}  # seq id -> (buffer, tokens mirrored)

    def view(self, seq_id: int, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        buf, have = self._arrays.get(seq_id, (None, 0))
        if buf is None or have > n or (have and int(buf[have - 1]) != tokens[have - 1]):
            buf, have = np.empty(max(64, 2 * n), dtype=np.int32), 0
        elif n > len(buf):
            grown = np.empty(2 * n, dtype=np.int32)
            grown[:have] = buf[:have]
            buf = grown
        if n > have:
            buf[have:n] = tokens[have:n]
        self._arrays[seq_id] = (buf, n)
        return buf[:n]

    def forget(self, seq_id: int) -> None:
        self._arrays.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._arrays)


class DraftProposer:
    """The draft-model method on the scheduler's side: every eligible sequence may propose up to k
    tokens; the executor's draft makes them. ``propose`` answers with placeholders (-1), one per
    token the plan asks the draft for (``BatchPlan.draft_proposals``)."""

    PLACEHOLDER = -1

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens

    def propose(self, tokens: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        return [self.PLACEHOLDER] * (self.k if k is None else k)
