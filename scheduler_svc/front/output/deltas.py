"""Turning the scheduler's per-step token updates into streamed client deltas.

One :class:`RequestStream` per request: it detokenizes each choice
incrementally, applies stop strings (which the scheduler cannot see: they live
in text space), keeps usage counts and timings, and builds the
:class:`RequestOutput` messages the servicer streams. It survives migration to
another executor, so text already streamed is never repeated.

:meth:`RequestStream.apply` is the one way an update becomes a delta. Its first branch
is the decode case (one choice, one token, no stop string, no log-probs), which runs for
every running request every step and so skips the bookkeeping the other cases need.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from pagedserve.engine_api import (
    ChoiceDelta,
    FinishReason,
    GenerationRequest,
    PromptScores,
    RequestOutput,
    RequestUpdate,
    SeqUpdate,
    TokenLogprob,
    Usage,
)
from scheduler_svc.front.output.detokenize import NO_STANDALONE_TEXTS, IncrementalDetokenizer, StandaloneTexts

# RequestStream.apply's ``stopped`` in its decode case: no choice ended, and the output is one
# token of choice 0 after its first, so the caller can count it without looking (shared: read only).
DECODE_CASE: list[int] = []
# Finish reasons the scheduler gives for the token it just appended (an EOS id, a stop_token_ids id).
_ENDED_BY_TOKEN = (FinishReason.EOS, FinishReason.STOP)


@dataclass(slots=True, eq=False)
class RequestStream:
    req: GenerationRequest
    tokenizer: Tokenizer
    num_choices: int
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    finish: dict[int, FinishReason] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # tokens streamed per choice
    cached_prompt_tokens: int = 0
    spec_tokens: tuple[int, int] = (0, 0)  # speculative decoding: (proposed, accepted), the latest totals
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    # (detokenizer, streamed tokens) of the one choice while apply() may take its decode case:
    # one choice, past its first token, no stop strings (apply() keeps it current).
    fast: tuple[IncrementalDetokenizer, list[int]] | None = None
    standalone_texts: StandaloneTexts = NO_STANDALONE_TEXTS  # the tokenizer's standalone_token_texts(), shared
    # Prompt log-probs (the request asked): the prompt's tokens 1.. scored so far, in order; handed over
    # once, with the first output that has tokens.
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    prompt_scores_sent: bool = False  # (True from the start when the request did not ask)
    plain: bool = False  # one choice, no stop strings: the decode case may apply (set from req)

    def __post_init__(self) -> None:
        p = self.req.params
        self.prompt_scores_sent = p.sampling.prompt_logprobs < 0
        self.plain = self.num_choices == 1 and not p.stop

    @property
    def done(self) -> bool:
        return len(self.finish) >= self.num_choices

    def _detok(self, index: int) -> IncrementalDetokenizer:
        d = self.detoks.get(index)
        if d is None:
            p = self.req.params
            d = IncrementalDetokenizer(self.tokenizer, self.req.prompt_token_ids, p.stop, p.skip_special_tokens,
                                       self.standalone_texts, p.include_stop_str_in_output, p.sampling.min_tokens)
            self.detoks[index] = d
            self.outputs.setdefault(index, [])
        return d

    def apply(self, update: RequestUpdate, now: float | None = None) -> tuple[RequestOutput, list[int]]:
        """Fold one scheduler update in; return the delta to stream and the choices a stop string ended.

        The caller must tell the scheduler to finish the returned choices (their blocks are released
        there), unless the update already finished them. ``now``: the caller's time.monotonic() (one
        reading for a whole step's updates).
        """
        seqs = update.seqs
        fast = self.fast
        if fast is not None and len(seqs) == 1 and update.prompt_logprobs is None:
            su = seqs[0]
            ids = su.new_token_ids
            if len(ids) == 1 and su.finish_reason is None and not su.logprobs:
                # The decode case (every running request, every step), kept lean: the one choice
                # past its first token takes one token; with no stop string its text cannot end it.
                detok, streamed = fast
                text = detok.step(ids[0])
                streamed.append(ids[0])
                if update.num_cached_prompt_tokens:
                    self.cached_prompt_tokens = update.num_cached_prompt_tokens
                if update.spec_proposed_tokens:
                    self.spec_tokens = (update.spec_proposed_tokens, update.spec_accepted_tokens)
                self.last_token_at = now or time.monotonic()
                return RequestOutput(self.req.request_id, [ChoiceDelta(0, text, ids)]), DECODE_CASE
        if update.prompt_logprobs is not None:
            self._take_scores(update.prompt_logprobs)
        if update.num_cached_prompt_tokens:
            self.cached_prompt_tokens = update.num_cached_prompt_tokens
        if update.spec_proposed_tokens:
            self.spec_tokens = (update.spec_proposed_tokens, update.spec_accepted_tokens)
        choices: list[ChoiceDelta] = []
        stopped: list[int] = []
        finish = self.finish
        for su in seqs:
            if su.index in finish:
                continue  # late tokens of a choice a stop string already ended
            delta = self._advance(su)
            if reason := delta.finish_reason:  # (UNSPECIFIED is 0)
                finish[su.index] = reason
                if reason == FinishReason.STOP and su.finish_reason is None:
                    stopped.append(su.index)
                choices.append(delta)
            elif delta.token_ids or delta.text:
                choices.append(delta)
        if choices:
            now = now or time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        out = self._output(choices)
        if choices and not self.prompt_scores_sent:
            out.prompt_logprobs = [None, *self.prompt_scores]
            self.prompt_scores_sent, self.prompt_scores = True, []
        if self.fast is None:
            # The decode case above applies from the next update on while a plain choice streams,
            # past its first token (which carries the timings and prompt scores).
            if self.plain and not finish and self.last_token_at is not None \
                    and (detok := self.detoks.get(0)) is not None:
                self.fast = (detok, self.outputs[0])
        elif finish:
            self.fast = None
        return out, stopped

    def _take_scores(self, piece: PromptScores) -> None:
        if self.prompt_scores_sent:
            return  # (a request that moved after its first token is not scored again)
        if piece.start == 1:
            self.prompt_scores = []  # a residency scores its prompt from token 1
        if piece.start == len(self.prompt_scores) + 1:
            self.prompt_scores.extend(piece.logprobs)

    def _advance(self, su: SeqUpdate) -> ChoiceDelta:
        """One choice's new tokens -> its delta (text, ids, logprobs, finish reason)."""
        detok = self.detoks.get(su.index) or self._detok(su.index)
        streamed = self.outputs[su.index]
        ids = su.new_token_ids
        # The EOS or stop token that ends the choice is streamed (id, log-prob) without its text,
        # unless include_stop_str_in_output asks for it (vLLM's rule).
        silent = ids[-1] if ids and su.finish_reason in _ENDED_BY_TOKEN \
            and not self.req.params.include_stop_str_in_output else None
        if len(ids) == 1 or not detok.has_stops:  # no token can be cut off by a stop string before it
            step = detok.step
            texted = ids if silent is None else ids[:-1]
            text = step(texted[0]) if len(texted) == 1 else "".join([step(tok) for tok in texted])
            streamed.extend(ids)
            # (a one-token list is the update's own, built for it; a longer one may be a beam's)
            delta = ChoiceDelta(su.index, text, ids if len(ids) == 1 else list(ids))
            if su.logprobs:
                delta.logprobs = list(su.logprobs)  # (the update's list stays the core's)
        else:  # token by token: the tokens after the one that completes a stop string are dropped
            delta = ChoiceDelta(su.index)
            logprobs = su.logprobs or ()
            last = len(ids) - 1
            for i, tok in enumerate(ids):
                if i < last or silent is None:
                    delta.text += detok.step(tok)
                delta.token_ids.append(tok)
                streamed.append(tok)
                if i < len(logprobs):
                    delta.logprobs.append(logprobs[i])
                if detok.stop_matched is not None:
                    break
        if detok.stop_matched is not None:
            delta.finish_reason, delta.stop_reason = FinishReason.STOP, detok.stop_matched
        elif su.finish_reason is not None:
            delta.finish_reason = su.finish_reason
            if su.finish_reason == FinishReason.STOP and streamed:
                delta.stop_reason = streamed[-1]  # (the stop token id that ended it)
            delta.text += detok.finish()
        return delta

    def abort(self, reason: FinishReason = FinishReason.ABORTED) -> RequestOutput:
        """Finish every open choice (abort, shutdown, failure) and release held text."""
        self.fast = None
        choices = []
        for index in range(self.num_choices):
            if index in self.finish:
                continue
            detok = self.detoks.get(index)
            choices.append(ChoiceDelta(index=index, text=detok.finish() if detok else "",
                                       finish_reason=reason))
            self.finish[index] = reason
        return self._output(choices)

    def _output(self, choices: list[ChoiceDelta]) -> RequestOutput:
        done = self.done
        usage = None
        if done:
            usage = Usage(prompt_tokens=len(self.req.prompt_token_ids),
                          completion_tokens=sum(len(v) for v in self.outputs.values()),
                          cached_prompt_tokens=self.cached_prompt_tokens,
                          spec_proposed_tokens=self.spec_tokens[0], spec_accepted_tokens=self.spec_tokens[1])
        return RequestOutput(self.req.request_id, choices, usage, finished=done)


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: each choice's text, tokens and logprobs in
    order, its last finish reason; the last output's usage and finished flag; the prompt's
    log-probs (which only the first output may have)."""
    if len(outs) == 1:
        return outs[0]
    merged: dict[int, ChoiceDelta] = {}
    for out in outs:
        for c in out.choices:
            m = merged.get(c.index)
            if m is None:
                merged[c.index] = m = ChoiceDelta(c.index)
            m.text += c.text
            m.token_ids.extend(c.token_ids)
            m.logprobs.extend(c.logprobs)
            if c.finish_reason != FinishReason.UNSPECIFIED:
                m.finish_reason, m.stop_reason = c.finish_reason, c.stop_reason
    last = outs[-1]
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return RequestOutput(last.request_id, list(merged.values()), last.usage, last.finished, prompt_logprobs)
