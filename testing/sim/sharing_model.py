"""Explicit block-level models of KV sharing for parallel sampling and beam search.

These mirror, step by step, what a paged KV cache manager does (paper §4.4):
sequences hold block tables into one refcounted pool; a fork shares every
block; appending into a shared, partly filled last block copies it first
(copy-on-write); dropping a sequence decrements its blocks' refcounts and frees
those at zero. After every generation step we count

* ``logical``:  sum over live sequences of their block-table lengths (blocks
  needed if nothing were shared), and
* ``physical``: blocks with refcount > 0 (blocks actually held).

The saving of paper Fig. 15 is ``1 - sum(physical) / sum(logical)`` over steps.
:func:`measure` runs a trace through the real scheduler (``benchmarks/sharing_savings.py``) and
cross-checks its numbers with these models on the same lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedserve.bench.workloads import synthetic_trace
from testing.sim.executor import BLOCK_SIZE, SimExecutor, simulate
from testing.sim.runs import make_scheduler, to_requests


@dataclass(slots=True)
class _Seq:
    table: list[int]  # physical block ids, logical order
    num_tokens: int
    score: float = 0.0


class BlockModel:
    """A refcounted block pool with fork, append (with CoW) and drop."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.refs: dict[int, int] = {}
        self._next_id = 0
        self.num_copies = 0

    def _new_block(self) -> int:
        self._next_id += 1
        self.refs[self._next_id] = 1
        return self._next_id

    def new_seq(self, num_tokens: int) -> _Seq:
        nblocks = -(-num_tokens // self.block_size)
        return _Seq([self._new_block() for _ in range(nblocks)], num_tokens)

    def fork(self, seq: _Seq) -> _Seq:
        for b in seq.table:
            self.refs[b] += 1
        return _Seq(list(seq.table), seq.num_tokens, seq.score)

    def append(self, seq: _Seq) -> None:
        """Add one token's KV slot: new block when full, copy-on-write when shared."""
        if seq.num_tokens % self.block_size == 0:
            seq.table.append(self._new_block())
        elif self.refs[seq.table[-1]] > 1:
            self._drop_block(seq.table[-1])
            seq.table[-1] = self._new_block()
            self.num_copies += 1
        seq.num_tokens += 1

    def drop(self, seq: _Seq) -> None:
        for b in seq.table:
            self._drop_block(b)
        seq.table = []

    def _drop_block(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            del self.refs[b]

    @property
    def physical(self) -> int:
        return len(self.refs)


def parallel_usage(prompt_len: int, output_len: int, n: int, block_size: int = 16) -> tuple[int, int]:
    """(sum of logical, sum of physical) blocks over the steps of one n-way sampled request."""
    pool = BlockModel(block_size)
    parent = pool.new_seq(prompt_len)  # the prompt is computed once, then forked
    seqs = [parent] + [pool.fork(parent) for _ in range(n - 1)]
    logical = physical = 0
    for _ in range(output_len):
        for s in seqs:
            pool.append(s)
        logical += sum(len(s.table) for s in seqs)
        physical += pool.physical
    return logical, physical


def _candidates(rng: np.random.Generator, width: int) -> np.ndarray:
    """Top-``width`` log-probs of one beam, best first (same law as SimExecutor's)."""
    return np.sort(np.log(rng.dirichlet(np.ones(width * 4))))[::-1][:width]


def beam_usage(prompt_len: int, output_len: int, width: int, rng: np.random.Generator,
               block_size: int = 16) -> tuple[int, int]:
    """(sum of logical, sum of physical) blocks over the steps of one beam search.

    Each step every live beam proposes its top ``width`` continuations; the
    ``width`` best by cumulative log-prob survive (a beam chosen k times forks
    k-1 children sharing its history), the others are pruned and their blocks
    released (paper §4.4, Fig. 9). Length penalty and early stopping are left
    out: every beam runs to ``output_len`` tokens, as with EOS ignored.
    """
    pool = BlockModel(block_size)
    beams = [pool.new_seq(prompt_len)]
    logical = physical = 0
    for _ in range(output_len):
        cands = [(b.score + float(lp), i) for i, b in enumerate(beams) for lp in _candidates(rng, width)]
        cands.sort(key=lambda c: -c[0])
        chosen: dict[int, list[float]] = {}
        for score, parent in cands[:width]:
            chosen.setdefault(parent, []).append(score)
        new_beams = []
        for i, b in enumerate(beams):
            scores = chosen.get(i)
            if scores is None:
                pool.drop(b)  # pruned: its blocks go back unless a survivor shares them
                continue
            # the parent continues as its first child; the others fork from it
            children = [b] + [pool.fork(b) for _ in scores[1:]]
            for child, score in zip(children, scores, strict=True):
                child.score = score
                new_beams.append(child)
        for child in new_beams:
            pool.append(child)
        beams = new_beams
        logical += sum(len(b.table) for b in beams)
        physical += pool.physical
    return logical, physical


RATES = {"alpaca": 1.0, "sharegpt": 0.05}  # low: (almost) no preemption even with 6 sequences per request
# A request preempted by recompute must recompute all n choices in one step (the scheduler does not
# chunk a multi-sequence group), so the token budget must hold 6 x 2048 tokens or it never resumes.
TOKEN_BUDGET = 6 * 2048


def measure(workload: str, mode: str, width: int, num_requests: int, seed: int = 0) -> dict:
    """Run one trace through the scheduler; time-averaged physical vs logical blocks."""
    trace = synthetic_trace(workload, num_requests, RATES[workload], seed=seed)
    n, beam = (width, 1) if mode == "parallel" else (1, width)
    sched = make_scheduler("paged", max_num_batched_tokens=TOKEN_BUDGET)
    kv = sched.kv
    acc = {"logical": 0.0, "physical": 0.0}

    def probe(now, plan, seconds):
        logical = sum(kv.num_blocks(s) for r in sched.running for s in r.live)
        acc["logical"] += logical * seconds
        acc["physical"] += kv.pool.num_used_blocks * seconds

    run = simulate(sched, SimExecutor(seed=seed), to_requests(trace, n=n, beam_width=beam), probe)
    if len(run.finish_time) != len(trace):
        raise RuntimeError(f"{len(trace) - len(run.finish_time)} requests did not finish")
    lg, ph = _model(trace, mode, width, seed)
    return {"workload": workload, "mode": mode, "width": width, "requests": len(trace),
            "saving": 1.0 - acc["physical"] / acc["logical"], "model_saving": 1.0 - ph / lg,
            "preemptions": sched.num_preemptions}


def _model(trace, mode: str, width: int, seed: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    lg = ph = 0
    for t in trace:
        if mode == "parallel":
            a, b = parallel_usage(t.prompt_len, t.output_len, width, BLOCK_SIZE)
        else:
            a, b = beam_usage(t.prompt_len, t.output_len, width, rng, BLOCK_SIZE)
        lg, ph = lg + a, ph + b
    return lg, ph
