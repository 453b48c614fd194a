"""Warm an executor up before it registers, so its first request runs at steady-state speed.

A process's first steps pay for things later steps reuse: OpenMP starting its threads,
the C kernels' and torch's scratch buffers growing to the step's size (and their pages
faulted in), oneDNN/MKL primitives for the prefill GEMMs, the sampler's code paths, Python's
own first calls. :func:`warm_up` runs a few real plans through the runner's public API
before the worker dials the scheduler: prefills of a serving-sized prompt, then decode steps
at batch 1 and at a small batch (the CPU fast path's sizes), greedy and sampled, and finally
frees its sequences and resets the runner. It writes only KV blocks the scheduler has not
handed out yet (nothing is registered), so no request can see them.
"""

from __future__ import annotations

import logging
import time

from executor_svc.runner import ModelRunner
from pagedserve.wire import BatchPlan, NewSeq, SamplingParams, pack_ids

log = logging.getLogger(__name__)

PROMPT_TOKENS = 128
DECODE_STEPS = 4
MAX_SEQS = 8


def _plan_sizes(num_blocks: int, block_size: int, max_len: int) -> tuple[int, int]:
    """(sequences, prompt tokens) that fit the pool and the model length."""
    prompt = max(1, min(PROMPT_TOKENS, max_len - DECODE_STEPS - 1))
    per_seq = -(-(prompt + DECODE_STEPS + 1) // block_size)
    while per_seq > num_blocks and prompt > 1:
        prompt //= 2
        per_seq = -(-(prompt + DECODE_STEPS + 1) // block_size)
    return max(0, min(MAX_SEQS, num_blocks // per_seq)), prompt


def _check(result, what: str) -> None:
    if result.error is not None:
        raise RuntimeError(f"warm-up {what} failed: {result.error}")


def warm_up(runner: ModelRunner) -> float:
    """Run the warm-up plans (see the module doc); returns the seconds it took."""
    start = time.perf_counter()
    bs, vocab = runner.kv.block_size, runner.model.cfg.vocab_size
    seqs, prompt = _plan_sizes(runner.kv.num_blocks, bs, runner.max_model_len)
    if seqs == 0:
        return 0.0
    per_seq = -(-(prompt + DECODE_STEPS + 1) // bs)
    step = 0
    for i in range(seqs):  # one prefill per step, as a token budget would split them
        sampling = SamplingParams(temperature=0.0) if i else SamplingParams(temperature=0.8, top_p=0.95, seed=0)
        tokens = [(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(prompt)]
        new = NewSeq(seq_id=i, token_ids=pack_ids(tokens), num_prompt_tokens=prompt,
                     block_ids=list(range(i * per_seq, (i + 1) * per_seq)), num_computed_tokens=0, sampling=sampling)
        _check(runner.execute(BatchPlan(step_id=step, scheduled_seq_ids=[i], num_new_tokens=[prompt], new_seqs=[new])),
               "prefill")
        step += 1
    for batch in (1, seqs):  # the decode path alone, then batched
        for _ in range(DECODE_STEPS // 2):
            ids = list(range(batch))
            _check(runner.execute(BatchPlan(step_id=step, scheduled_seq_ids=ids, num_new_tokens=[1] * batch)),
                   "decode")
            step += 1
    _check(runner.execute(BatchPlan(step_id=step, free_seq_ids=list(range(seqs)))), "free")
    runner.reset()
    took = time.perf_counter() - start
    log.info("warmed up in %.2f s (%d prefills of %d tokens, decode at batch 1 and %d)", took, seqs, prompt, seqs)
    return took
