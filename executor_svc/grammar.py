"""Structured outputs on the executor: each constrained sequence's grammar matcher and token mask.

The executor samples, knows every token of its sequences and appends its own samples, so the
grammar runs here (docs/ARCHITECTURE.md, "Structured outputs"): the scheduler sends a
sequence's spec once per residency (``SamplingParams.structured`` in ``NewSeq``) and nothing per
step, where shipping a bitmask per sequence per step would cost 16 KB each at a 128K vocabulary.

- :class:`GrammarBackend`, one per process: the tokenizer's vocabulary as xgrammar reads it
  (built in a worker thread at start-up), and compiled grammars cached by spec (LRU), compiled
  on a small pool of worker threads: xgrammar releases the GIL while it compiles, so the
  compute thread keeps serving other sequences meanwhile.
- :class:`SeqGrammar`, one per constrained sequence: compiling starts when the sequence is
  registered. Its matcher is built on first use from the compiled grammar and the sequence's
  output tokens so far (after preemption by recompute, a swap or a migration the executor is sent
  the tokens, and the grammar state follows them); a fork (n > 1) copies its parent's matcher.
  A sequence whose first sample comes before its grammar has compiled waits for the compile
  (``COMPILE_TIMEOUT_S`` at most; past it that sequence fails, as one whose grammar does not
  compile here does: the other rows of the step are sampled as usual).
- :class:`GrammarMasks`: one step's token bitmask, a bit per vocabulary id and row, filled for
  the constrained rows (in parallel, by xgrammar's batch matcher) right after the step's forward
  was launched, so on a GPU the mask is computed while the device runs; the sampler applies it.

A sequence whose matcher has terminated (it sampled an end token: with asynchronous scheduling
one more step may be computed before the scheduler finishes it) may only sample end tokens; that
token is never streamed.

Whitespace: JSON is generated without free whitespace (``any_whitespace=False``: one space after
``,`` and ``:``, as ``json.dumps`` writes it). A random-weight model left free to emit
whitespace between tokens of an object may never close it; a real model loses nothing.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pagedserve.gguf_tokenizer import build_tokenizer
from pagedserve.model_dir import is_gguf, open_gguf
from pagedserve.wire import (
    STRUCTURED_CHOICE,
    STRUCTURED_GRAMMAR,
    STRUCTURED_JSON,
    STRUCTURED_REGEX,
    Structured,
)

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 60.0  # a sample waits at most this long for its sequence's grammar to compile
CACHE_ENTRIES = 128  # compiled grammars kept (LRU); at a 128K vocabulary a JSON schema's is ~0.1-1 MB


class GrammarError(RuntimeError):
    """A sequence's grammar cannot be served (it does not compile here, or its tokens do not match it).
    ``rejected``: the fault is the request's own (its grammar does not compile on this engine, or
    this executor serves no structured outputs), so its client is told why and the step is not
    held against the executor."""

    def __init__(self, message: str, *, rejected: bool = False) -> None:
        super().__init__(message)
        self.rejected = rejected


def _xgrammar():
    import xgrammar  # imported on first use: it pulls transformers, which a plain executor does not need

    return xgrammar


class GrammarBackend:
    """Compiled grammars of one executor process, for one tokenizer."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int], threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._compiler: Future = self._pool.submit(_compiler, tokenizer_json, vocab_size, list(eos_token_ids),
                                                   threads)
        self._compiler.add_done_callback(functools.partial(_log_compiler_failure, tokenizer_json))
        self._cache: collections.OrderedDict[tuple[int, str], Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on first use
        self._batch_threads = max(1, min(8, os.cpu_count() or 1))
        # One step's bitmask at a time (a step's masks are applied before the next step's are filled):
        # reused, since allocating 4 MB a step (256 rows at a 128K vocabulary) cost as much as filling it.
        self._bitmask = torch.empty(0, (vocab_size + 31) // 32, dtype=torch.int32)

    @classmethod
    def for_model(cls, model_dir: Path, vocab_size: int) -> GrammarBackend | None:
        """The backend of a model directory or GGUF file, or None when a directory has no tokenizer.json
        (then structured requests fail on this executor with a clear error)."""
        if Path(model_dir).is_file():  # a GGUF file: the tokenizer is built from its vocabulary
            return cls(Path(model_dir), vocab_size, list(open_gguf(Path(model_dir)).eos_token_ids))
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            log.warning("%s has no tokenizer.json: this executor cannot serve structured outputs", model_dir)
            return None
        return cls(path, vocab_size, _config_eos_ids(Path(model_dir)))

    def compile(self, spec: Structured) -> Future:
        """The compiled grammar of ``spec`` (a future: compiling runs on the worker threads)."""
        key = (spec.kind, spec.spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec.kind, spec.spec)
            self._cache[key] = fut
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def track(self, spec: Structured, end_token_ids: Sequence[int], outputs: Sequence[int]) -> SeqGrammar:
        """The grammar state of a sequence registered with ``outputs`` generated already."""
        return SeqGrammar(self.compile(spec), list(end_token_ids), list(outputs))

    def _compile(self, kind: int, spec: str):
        compiler = self._compiler.result()
        if kind == STRUCTURED_JSON:
            return compiler.compile_grammar(json_schema_grammar(spec))
        if kind == STRUCTURED_REGEX:
            return compiler.compile_regex(spec)
        if kind == STRUCTURED_CHOICE:
            return compiler.compile_grammar(choice_grammar(json.loads(spec)))
        if kind == STRUCTURED_GRAMMAR:
            return compiler.compile_grammar(spec)
        raise GrammarError(f"unknown structured output kind {kind}")

    def accept(self, grammars: Sequence[SeqGrammar], tokens: Sequence[int]) -> None:
        """Each of ``grammars`` takes its sequence's new token: the built, live matchers in one call
        into xgrammar (a step's worth of calls from Python cost as much as the matching itself)."""
        live: list[SeqGrammar] = []
        live_tokens: list[int] = []
        for g, tok in zip(grammars, tokens, strict=True):
            if g._matcher is None or g.terminated or g._error is not None:
                g.accept(tok)  # (not built yet: replayed when it is; terminated: takes nothing)
            else:
                live.append(g)
                live_tokens.append(tok)
                g.terminated = tok in g.end_token_ids  # (an end token the grammar allowed ends it)
        if live:
            ok = _xgrammar().BatchGrammarMatcher.batch_accept_token([g._matcher for g in live], live_tokens)
            if not all(ok):
                for g, tok, accepted in zip(live, live_tokens, ok, strict=True):
                    if not accepted and g._error is None:
                        g._error = f"token {tok} does not match its grammar"

    def masks(self, seqs: Sequence[Any]) -> GrammarMasks | None:
        """The token mask of one step's sampling rows (``seqs``: objects with a ``grammar``
        attribute, None for unconstrained rows), or None when no row is constrained. A row whose
        grammar allows no token fails, rejected (``NO_TOKEN_ALLOWED``)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(seqs):
            self._bitmask = torch.empty(len(seqs), self._bitmask.shape[1], dtype=torch.int32)
        bitmask = self._bitmask[:len(seqs)]
        masks = GrammarMasks(bitmask, [], self.vocab_size)
        live, live_rows = [], []
        for i in rows:
            g: SeqGrammar = seqs[i].grammar
            try:
                matcher = g.matcher()
            except Exception as exc:  # noqa: BLE001  this row cannot be served: its sequence fails alone
                masks.failed[i] = str(exc)
                if isinstance(exc, GrammarError) and exc.rejected:
                    masks.rejected.add(i)
                continue
            masks.rows.append(i)
            if g.terminated:  # a step computed past its end token: only end tokens again
                _allow_only(bitmask[i], g.end_token_ids)
            else:
                live.append(matcher)
                live_rows.append(i)
        if live:
            if self._batch is None:
                self._batch = _xgrammar().BatchGrammarMatcher(max_threads=self._batch_threads)
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)
            for i, allows in zip(live_rows, bitmask[live_rows].any(dim=1).tolist(), strict=True):
                if not allows:  # (sampled anyway, any token would break it: a 500 for the request's fault)
                    masks.rows.remove(i)
                    masks.failed[i] = NO_TOKEN_ALLOWED
                    masks.rejected.add(i)
        return masks


# A live matcher whose mask allows no token: its grammar's language is empty (root ::= root) or
# goes on only with text this vocabulary cannot spell. The request's own fault (a 400 naming it).
NO_TOKEN_ALLOWED = "its grammar allows no token here (it matches no text, or needs text this model cannot write)"


def _compiler(tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int], threads: int):
    xgr = _xgrammar()
    from transformers import PreTrainedTokenizerFast

    if is_gguf(tokenizer_json):  # its vocabulary, not a tokenizer.json
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(open_gguf(tokenizer_json)))
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))  # local file: nothing downloads
    # Each matcher is given its sequence's own end tokens (SamplingParams.end_token_ids); these are
    # the vocabulary's defaults, which xgrammar requires.
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids or [0])
    return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)  # (cached above, by spec)


def _log_compiler_failure(tokenizer_json: Path, fut: Future) -> None:
    """The vocabulary could not be read (each structured sequence's step then fails saying why):
    said once, at start-up, instead of only in each failed step."""
    exc = fut.exception()
    if exc is not None:
        log.error("cannot build the grammar compiler from %s: structured outputs will fail on this executor",
                  tokenizer_json, exc_info=exc)


def _config_eos_ids(model_dir: Path) -> list[int]:
    value = json.loads((model_dir / "config.json").read_text()).get("eos_token_id") \
        if (model_dir / "config.json").is_file() else None
    ids = value if isinstance(value, list) else [value]
    return [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= 0]


# xgrammar (0.2.9) writes the characters of a string with a length bound as [^"\\\r\n], which lets raw
# control characters into it: JSON forbids them (RFC 8259, section 7) and json.loads refuses them.
# Its unbounded strings have the right class; bounded ones get it here (tests/unit/executor/test_structured_outputs.py
# fails if a new xgrammar changes what it writes).
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def json_schema_grammar(schema: str) -> str:
    """The GBNF grammar of a JSON schema's instances, as the executor compiles it: no free whitespace
    (one space after ``,`` and ``:``), properties not listed are not allowed unless the schema says so."""
    ebnf = str(_xgrammar().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return ebnf.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


def choice_grammar(choices: Sequence[str]) -> str:
    """A GBNF grammar whose language is exactly ``choices`` (JSON string escapes are GBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class SeqGrammar:
    """One sequence's grammar: its compile (a future) and, once used, its matcher."""

    __slots__ = ("_future", "_matcher", "_pending", "_error", "end_token_ids", "terminated")

    def __init__(self, future: Future, end_token_ids: list[int], outputs: list[int]) -> None:
        self._future = future
        self._matcher: Any = None
        self._pending = outputs  # tokens to replay when the matcher is built
        self._error: str | None = None  # a token did not match: the next mask reports it
        self.end_token_ids = frozenset(end_token_ids)
        self.terminated = False  # it took an end token: it may only take end tokens again

    def matcher(self):
        """The matcher, built on first use (waits for the compile; GrammarError if it failed)."""
        if self._error is not None:
            raise GrammarError(self._error)
        if self._matcher is None:
            try:
                compiled = self._future.result(timeout=COMPILE_TIMEOUT_S)
            except TimeoutError:
                raise GrammarError(f"the grammar did not compile within {COMPILE_TIMEOUT_S:g}s",
                                   rejected=True) from None
            except GrammarError as exc:
                raise GrammarError(str(exc), rejected=True) from exc
            except Exception as exc:  # noqa: BLE001  a spec the API edge let through but this engine refuses
                raise GrammarError(f"the grammar does not compile here (xgrammar): {_engine_message(exc)}",
                                   rejected=True) from exc
            m = _xgrammar().GrammarMatcher(compiled, override_stop_tokens=sorted(self.end_token_ids) or None)
            for tok in self._pending:
                if not m.is_terminated() and not m.accept_token(tok):
                    raise GrammarError(f"its tokens so far do not match its grammar (token {tok})")
            self._matcher, self._pending, self.terminated = m, [], m.is_terminated()
        return self._matcher

    def accept(self, token_id: int) -> None:
        """The sequence appended ``token_id`` (sampled under this grammar's mask). Never raises: the
        runner appends a step's tokens all or nothing; a mismatch fails the sequence's next sample."""
        m = self._matcher
        if m is None:
            self._pending.append(token_id)
        elif not self.terminated:
            if not m.accept_token(token_id) and self._error is None:
                self._error = f"token {token_id} does not match its grammar"
            self.terminated = m.is_terminated()

    def fork(self) -> SeqGrammar:
        """A copy for a child sequence (n > 1): the same state, advanced separately from now on."""
        child = SeqGrammar(self._future, list(self.end_token_ids), list(self._pending))
        if self._matcher is not None:
            child._matcher, child.terminated = self._matcher.fork(), self.terminated
        return child


def _engine_message(exc: Exception) -> str:
    """xgrammar's error for a client: without the time and C++ source line its messages start with
    (``[06:45:01] /project/cpp/regex_converter.cc:94: Regex parsing error ...``)."""
    return _CPP_LOG_PREFIX.sub("", str(exc)).strip()


_CPP_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def unserved(reason: str) -> SeqGrammar:
    """The grammar of a sequence this executor cannot constrain: its first sample fails, saying why."""
    fut: Future = Future()
    fut.set_exception(GrammarError(reason, rejected=True))
    return SeqGrammar(fut, [], [])


def _allow_only(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    row.zero_()
    for t in token_ids:
        if 0 <= t < 32 * row.shape[0]:
            row[t // 32] |= _bit(t % 32)


def _bit(j: int) -> int:
    return (1 << j) - (1 << 32) if j == 31 else 1 << j  # int32: bit 31 is the sign


class GrammarMasks:
    """One step's bitmask ``[num_rows, ceil(vocab / 32)] int32`` (bit ``t % 32`` of word ``t // 32``
    set: token ``t`` allowed), the rows it constrains, and the constrained rows it cannot serve
    (``failed``: row -> why; ``rejected``: those of them failed for their request's own grammar,
    :class:`GrammarError`). A failed row is left unmasked: the runner drops its sequence and
    reports it failed instead of appending what it sampled; the step's other rows are served."""

    __slots__ = ("bitmask", "rows", "vocab_size", "failed", "rejected")

    def __init__(self, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        self.bitmask, self.rows, self.vocab_size = bitmask, rows, vocab_size
        self.failed: dict[int, str] = {}
        self.rejected: set[int] = set()

    @classmethod
    def unserved(cls, seqs: Sequence[Any]) -> GrammarMasks:
        """The masks of a step whose constrained rows this executor cannot serve (no backend)."""
        masks = cls(torch.empty(0, 0, dtype=torch.int32), [], 0)
        masks.failed = {i: "this executor cannot serve structured outputs (no tokenizer.json)"
                        for i, s in enumerate(seqs) if s.grammar is not None}
        masks.rejected = set(masks.failed)
        return masks

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits of the constrained rows to -inf, in place (logits ``[num_rows, V]``)."""
        if not self.rows:
            return
        vocab = min(logits.shape[1], self.vocab_size)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            _xgrammar().apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=vocab, indices=self.rows,
                                                    backend="cpu")
            if logits.shape[1] > vocab:
                logits[self.rows, vocab:] = float("-inf")
            return
        rows = torch.tensor(self.rows, device=logits.device)
        words = self.bitmask[self.rows].to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
        if allowed.shape[1] < logits.shape[1]:  # ids past the tokenizer's vocabulary: never allowed
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    def allowed(self, row: int) -> torch.Tensor:
        """The ids row ``row`` may sample (for tests and the simulated executor)."""
        words = self.bitmask[row]
        shifts = torch.arange(32, dtype=torch.int32)
        bits = ((words[:, None] >> shifts) & 1).bool().flatten()[:self.vocab_size]
        return torch.nonzero(bits).flatten()
