"""The simulated executor with structured outputs: constrained sequences sample only ids their grammar allows.

:class:`GrammarSimExecutor` is :class:`~testing.sim.executor.SimExecutor` with the real
executor's grammar code (``executor_svc/grammar.py``): a sequence registered with a structured
spec gets a :class:`~executor_svc.grammar.SeqGrammar` (compiled on the backend's worker threads,
cached by spec), each step's constrained rows get their token masks in one batch
(``GrammarBackend.masks``, as the runner fills them after launching a forward), each draws an
allowed id (the lowest set bit of a random non-empty word of its mask row: not the model's
distribution, only its support) and the matchers take them in one batch (``GrammarBackend.accept``,
as the runner's do). ``grammar_seconds`` is the time the masks and the matchers took (the draw,
``draw_seconds``, stands in for the device's sampling): the executor's grammar cost per step,
which a real executor spends while the device computes (the mask is filled after the forward is
launched).

``structured_executor_process`` is ``engine_harness.executor_process`` for it (a process target).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.engine_harness import SIM_BLOCKS, SleepingRunner
from pagedserve import wire
from testing.sim.executor import CostModel, SimExecutor


@dataclass(slots=True)
class _Row:
    seq_id: int
    grammar: object


@dataclass
class GrammarSimExecutor(SimExecutor):
    backend: object = None  # executor_svc.grammar.GrammarBackend
    grammars: dict = field(default_factory=dict)  # seq id -> SeqGrammar
    grammar_seconds: float = 0.0  # filling masks and advancing matchers
    draw_seconds: float = 0.0  # drawing allowed ids from the masks (a stand-in for the device's sampling)
    _owed: list = field(default_factory=list)  # (seq id, index in sampled_token_ids) drawn under a mask

    def _apply_deltas(self, plan: wire.BatchPlan) -> None:
        super()._apply_deltas(plan)
        for sid in plan.free_seq_ids:
            self.grammars.pop(sid, None)
        for ns in plan.new_seqs:
            spec = ns.sampling.structured
            if spec is not None:
                self.grammars[ns.seq_id] = self.backend.track(spec, ns.sampling.end_token_ids,
                                                              ns.tokens()[ns.num_prompt_tokens:])
        for fk in plan.forks:
            if fk.parent_seq_id in self.grammars:
                self.grammars[fk.child_seq_id] = self.grammars[fk.parent_seq_id].fork()

    def _sample(self, seq_id: int, st, result: wire.StepResult) -> None:
        if seq_id not in self.grammars:
            super()._sample(seq_id, st, result)
            return
        self._owed.append((seq_id, len(result.sampled_token_ids)))  # drawn once the step's masks are filled
        result.sampled_seq_ids.append(seq_id)
        result.sampled_token_ids.append(0)
        st.num_tokens += 1

    def execute(self, plan: wire.BatchPlan) -> wire.StepResult:
        self._owed = []
        result = super().execute(plan)
        if self._owed:
            start = time.perf_counter()
            rows = [_Row(sid, self.grammars[sid]) for sid, _ in self._owed]
            masks = self.backend.masks(rows)
            drawn = time.perf_counter()
            tokens = self._allowed_ids(masks.bitmask.numpy())  # (the device's sampling, in a real executor)
            for (_, at), tok in zip(self._owed, tokens, strict=True):
                result.sampled_token_ids[at] = tok
            accepting = time.perf_counter()
            self.backend.accept([r.grammar for r in rows], tokens)
            self.grammar_seconds += drawn - start + time.perf_counter() - accepting
            self.draw_seconds += accepting - drawn
        return result

    def _allowed_ids(self, words: np.ndarray) -> list[int]:
        """An allowed id per row of ``words`` (int32 bit words): the lowest set bit of a random
        non-empty word of the row: one of 8 random words where one is non-empty (inside a string most
        are), else one of all the row's non-empty words (found for those rows at once)."""
        n, width = words.shape
        everyone = np.arange(n)
        cand = self._rng.integers(0, width, size=(n, 8))
        hit = words[everyone[:, None], cand] != 0
        index = cand[everyone, hit.argmax(axis=1)]
        missed = np.flatnonzero(~hit.any(axis=1))
        if len(missed):
            flat = np.flatnonzero(words[missed] != 0)  # (flat on booleans: numpy's fast path)
            rows, cols = flat // width, flat % width
            counts = np.bincount(rows, minlength=len(missed))
            starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            index[missed] = cols[starts + (self._rng.random(len(missed)) * counts).astype(np.int64)]
        word = words[everyone, index].astype(np.int64) & 0xFFFFFFFF
        return (32 * index + np.log2(word & -word).astype(np.int64)).tolist()


class GrammarSleepingRunner(SleepingRunner):
    """SleepingRunner over GrammarSimExecutor; ``grammar_s`` (a shared mp.Value) accumulates its grammar time."""

    def __init__(self, vocab: int, eos: int | None, step_s: float, stats, tokenizer_json: str, grammar_s,
                 warm: wire.Structured | None = None) -> None:
        from executor_svc.grammar import GrammarBackend

        self.backend = GrammarBackend(tokenizer_json, vocab, [] if eos is None else [eos])
        if warm is not None:  # as a serving executor would have: its vocabulary read, a hot spec compiled
            self.backend.compile(warm).result()
        self.grammar_s = grammar_s
        super().__init__(vocab, eos, step_s, stats)

    def reset(self) -> None:
        self.sim = GrammarSimExecutor(CostModel(), eos_token_id=self.eos, vocab_size=self.vocab, backend=self.backend)

    def execute(self, plan: wire.BatchPlan) -> wire.StepResult:
        before = self.sim.grammar_seconds
        result = super().execute(plan)
        with self.grammar_s.get_lock():
            self.grammar_s.value += self.sim.grammar_seconds - before
        return result


def structured_executor_process(endpoint: str, name: str, vocab: int, eos: int | None, step_s: float, stats,
                                tokenizer_json: str, grammar_s, warm: wire.Structured | None = None) -> None:
    """A real ExecutorWorker around a GrammarSleepingRunner: a process target (``warm``: compiled first)."""
    from executor_svc.worker import ExecutorWorker

    hs = wire.Handshake(executor_id=name, wire_version=wire.WIRE_VERSION, model_fingerprint="sim",
                        model_name="sim", architecture="SimExecutor", vocab_size=vocab, block_size=16,
                        num_device_blocks=SIM_BLOCKS, num_cpu_blocks=0, max_model_len=4096, dtype="float16",
                        device="sim")
    runner = GrammarSleepingRunner(vocab, eos, step_s, stats, tokenizer_json, grammar_s, warm)
    ExecutorWorker(endpoint, runner, hs, drain_timeout=1.0).run()
