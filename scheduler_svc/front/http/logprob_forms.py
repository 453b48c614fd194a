"""Log-probabilities in the OpenAI API's two forms, and vLLM's prompt log-probs.

- completions: ``{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}``; each
  position's ``top_logprobs`` lists up to ``logprobs`` + 1 entries and always the sampled token
  (``logprobs: 0`` gives the sampled token's alone). Echoed prompt tokens come first; the first
  has no log-prob (``null``).
- chat: ``content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``.
- ``prompt_logprobs`` (vLLM's extension): one entry per prompt token, ``null`` for the first, else
  ``{token_id: {logprob, rank, decoded_token}}`` for the prompt's token and its alternatives. The
  prompt token's rank is the executor's (``PromptLogprobs.token_ranks``: 1 + the tokens more
  likely, over the whole vocabulary, as vLLM ranks); from an executor that predates it, its rank
  among the top k, or ``null`` outside them (vLLM's ``Logprob.rank`` is optional), never a guess.

A token's text is its id decoded alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.engine_api import TokenLogprob

Text = Callable[[int], str]


def completion_logprobs(text: Text, lps: Sequence[TokenLogprob | None], offset: int,
                        token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The completions form of ``lps`` (None: a position without log-probs, the prompt's first
    token, whose id is ``token_ids[i]``) starting at text offset ``offset``; ``next_offset`` is
    where the text after them starts."""
    tokens, values, tops, offsets = [], [], [], []
    for i, lp in enumerate(lps):
        token = text(lp.token_id if lp is not None else token_ids[i])
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(lp.logprob)
        top = {text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
        top.setdefault(token, lp.logprob)  # the sampled token is always listed
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets,
            "next_offset": offset}


def chat_logprobs(text: Text, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [dict(_entry(text, lp.token_id, lp.logprob),
                 top_logprobs=[_entry(text, t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)])
            for lp in lps]


def _entry(text: Text, token_id: int, logprob: float) -> dict[str, Any]:
    token = text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def prompt_logprobs_body(text: Text, lps: Sequence[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        ranked = sorted(zip(lp.top_token_ids, lp.top_logprobs, strict=True), key=lambda x: -x[1])
        entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": text(t)} for r, (t, v) in enumerate(ranked)}
        if lp.rank is not None:  # the executor's: 1 + the tokens more likely, over the whole vocabulary
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(lp.token_id)}
        elif str(lp.token_id) not in entry:  # outside the top k, from an executor that reports no rank
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": None, "decoded_token": text(lp.token_id)}
        out.append(entry)
    return out
