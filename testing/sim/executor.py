"""A simulated executor in virtual time, with a cost model of OPT-13B on one A100-40GB.

The real :class:`~scheduler_svc.sched.scheduler.Scheduler` plans every step; this
executor applies the plan deltas with a real executor's own walk
(``pagedserve/wire/plan_deltas.py``: it keeps each sequence's token count and
computed count; no block tables, no KV), draws
a token for every sequence that finished its pending tokens, and instead of
running a model returns how long the step *would* take on the paper's hardware.

Cost model (paper §6.1 / Table 1: OPT-13B, one NVIDIA A100 40 GB)
-----------------------------------------------------------------
A step is memory-bound (decode) or compute-bound (prefill), whichever is slower,
plus framework overhead::

    t_mem     = (W + kv_bytes_per_token * (sum of context tokens) * k_paged) / (BW * eff_bw)
    t_compute = (2 * P * batched_tokens + 4 * L * H * attended_pairs) / (FLOPS * eff_flops)
    t_step    = max(t_mem, t_compute) + t_fixed + t_seq * num_seqs

=====================  ============  ====================================================
constant               value         where it comes from
=====================  ============  ====================================================
P (parameters)         12.85e9       OPT-13B (Zhang et al. 2022, Table 1 of the OPT paper)
W (weight bytes)       25.7e9        P x 2 bytes (fp16): every decode step reads all weights
L, H                   40, 5120      OPT-13B layers and hidden size
kv_bytes_per_token     819200        2 (K,V) x L x H x 2 bytes = 800 KB (paper §3)
BW                     1.555e12 B/s  A100-40GB SXM HBM2 datasheet bandwidth
eff_bw                 0.8           typical achievable share of peak HBM bandwidth
FLOPS                  312e12        A100 dense fp16 tensor-core peak (datasheet)
eff_flops              0.5           typical large-GEMM efficiency in serving engines
k_paged                1.2           PagedAttention kernel 20-26% slower than a contiguous
                                     one (paper §7.1, Fig. 18a); applied to every
                                     allocator alike, so it never favours paging
t_fixed                8 ms          assumption: per-step Python scheduling, input
                                     preparation, kernel launches, sampling (2023 vLLM)
t_seq                  0.05 ms       assumption: per-sequence host work per step
=====================  ============  ====================================================

The two overhead terms are assumptions, not measurements; with them a step of
30 sequences holding ~12K context tokens takes ~40 ms, close to what Little's
law implies for the paper's Fig. 13 point (30.42 batched requests at 2 req/s,
338 output tokens per request: 30.42 / (2 x 338) = 45 ms per step). A larger
per-sequence term (0.2 ms, our first choice) makes big batches host-bound and
erases the paged allocator's advantage on the short Alpaca requests, where
batches exceed 100 sequences; PERF.md discusses this sensitivity.

Every allocator is simulated with this same executor and cost model: only the
scheduler's memory management differs between the curves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedserve.wire import BatchPlan, SeqLogprobs, StepResult
from pagedserve.wire.messages import BlockUpdate, Fork, NewSeq
from pagedserve.wire.plan_deltas import DeltaTarget, apply_deltas


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step time of OPT-13B on one A100-40GB as a function of the batch's shape."""

    num_params: float = 12.85e9
    weight_bytes: float = 25.7e9
    num_layers: int = 40
    hidden_size: int = 5120
    kv_bytes_per_token: int = 819_200
    hbm_bandwidth: float = 1.555e12
    bandwidth_efficiency: float = 0.8
    peak_flops: float = 312e12
    flops_efficiency: float = 0.5
    paged_kernel_factor: float = 1.2
    fixed_overhead_s: float = 8e-3
    per_seq_overhead_s: float = 5e-5

    def step_time(self, batched_tokens: int, context_tokens: int, attended_pairs: int, num_seqs: int) -> float:
        """Seconds for one step.

        ``batched_tokens``: new tokens computed this step (prefill chunks + 1 per decode);
        ``context_tokens``: sum over scheduled sequences of their context length after the step
        (the KV read by attention); ``attended_pairs``: sum over new tokens of the positions each
        attends to (attention FLOPs); ``num_seqs``: scheduled sequences.
        """
        if num_seqs == 0:
            return 0.0
        kv_read = self.kv_bytes_per_token * context_tokens * self.paged_kernel_factor
        t_mem = (self.weight_bytes + kv_read) / (self.hbm_bandwidth * self.bandwidth_efficiency)
        flops = 2.0 * self.num_params * batched_tokens + 4.0 * self.num_layers * self.hidden_size * attended_pairs
        t_compute = flops / (self.peak_flops * self.flops_efficiency)
        return max(t_mem, t_compute) + self.fixed_overhead_s + self.per_seq_overhead_s * num_seqs


# KV cache of the paper's setting: 12 GiB for OPT-13B on A100-40GB = 15.7K token slots (§6.1).
KV_CACHE_BYTES = 12 * 1024**3
BLOCK_SIZE = 16
PAPER_NUM_SLOTS = KV_CACHE_BYTES // CostModel().kv_bytes_per_token  # 15728
PAPER_NUM_BLOCKS = PAPER_NUM_SLOTS // BLOCK_SIZE  # 983


@dataclass(slots=True)
class _SeqState:
    num_tokens: int
    num_computed: int
    beam_candidates: int
    logprobs: int = -1  # top alternatives its request asked for with each token (-1: no log-probs)


class _SimDeltas(DeltaTarget[_SeqState]):
    """The deltas on the simulated counts (block updates and moves change nothing here)."""

    def new_seq(self, ns: NewSeq) -> _SeqState:
        sp = ns.sampling
        return _SeqState(ns.num_tokens, ns.num_computed_tokens, sp.beam_candidates,
                         sp.logprobs if sp.want_logprobs else -1)

    def fork(self, parent: _SeqState, fork: Fork) -> _SeqState:
        return _SeqState(parent.num_tokens, parent.num_computed, parent.beam_candidates, parent.logprobs)

    def append_token(self, state: _SeqState, seq_id: int, token: int) -> _SeqState:
        state.num_tokens += 1
        return state

    def update_blocks(self, state: _SeqState, update: BlockUpdate) -> _SeqState:
        return state


_DELTAS = _SimDeltas()


@dataclass(slots=True)
class StepShape:
    """What the last executed step looked like (for statistics)."""

    num_seqs: int = 0
    batched_tokens: int = 0
    context_tokens: int = 0
    seconds: float = 0.0


@dataclass
class SimExecutor:
    """Applies plan deltas like a real executor and returns simulated step times.

    Sampled tokens are random ids that are never ``eos_token_id`` or, with ``text_ids``, that
    text's tokens in order (each sequence from its own offset), so that what is streamed
    detokenizes as text does; beam sequences get ``beam_candidates`` random (token, log-prob)
    pairs, best first.
    """

    cost: CostModel = field(default_factory=CostModel)
    eos_token_id: int | None = 2
    vocab_size: int = 50272
    seed: int = 0
    text_ids: list[int] | None = None
    seqs: dict[int, _SeqState] = field(default_factory=dict)
    last: StepShape = field(default_factory=StepShape)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def execute(self, plan: BatchPlan) -> StepResult:
        self._apply_deltas(plan)
        result = StepResult(step_id=plan.step_id)
        shape = StepShape(num_seqs=len(plan.scheduled_seq_ids))
        pairs = 0
        for seq_id, n_new in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True):
            st = self.seqs.get(seq_id)
            if st is None:
                raise RuntimeError(f"plan {plan.step_id} schedules unknown sequence {seq_id}")
            if st.num_computed + n_new > st.num_tokens:
                raise RuntimeError(f"seq {seq_id}: computing {n_new} tokens past its {st.num_tokens} tokens")
            shape.batched_tokens += n_new
            shape.context_tokens += st.num_computed + n_new
            pairs += n_new * st.num_computed + n_new * (n_new + 1) // 2
            st.num_computed += n_new
            if st.num_computed == st.num_tokens:
                self._sample(seq_id, st, result)
        shape.seconds = self.cost.step_time(shape.batched_tokens, shape.context_tokens, pairs, shape.num_seqs)
        result.model_seconds = shape.seconds
        self.last = shape
        return result

    def _apply_deltas(self, plan: BatchPlan) -> None:
        apply_deltas(plan, self.seqs, _DELTAS)

    def _token(self) -> int:
        tok = int(self._rng.integers(4, self.vocab_size))
        return tok + 1 if tok == self.eos_token_id else tok

    def _text_token(self, seq_id: int, position: int) -> int:
        ids = self.text_ids
        tok = ids[(seq_id * 7919 + position) % len(ids)]  # (a prime stride: sequences read apart)
        return tok + 1 if tok == self.eos_token_id else tok

    def _sample(self, seq_id: int, st: _SeqState, result: StepResult) -> None:
        if st.beam_candidates > 0:
            k = st.beam_candidates
            logprobs = np.sort(np.log(self._rng.dirichlet(np.ones(k * 4))))[::-1][:k]
            result.beam_candidates.append(SeqLogprobs(seq_id, 0.0, [self._token() for _ in range(k)],
                                                      [float(x) for x in logprobs]))
            return
        tok = self._token() if self.text_ids is None else self._text_token(seq_id, st.num_tokens)
        result.sampled_seq_ids.append(seq_id)
        result.sampled_token_ids.append(tok)
        st.num_tokens += 1
        if st.logprobs >= 0:  # (fixed values: what a step reports, not what a model would say)
            top = [(tok + i) % self.vocab_size for i in range(st.logprobs)]
            result.logprobs.append(SeqLogprobs(seq_id, -0.5, top, [-0.5 - i for i in range(st.logprobs)]))


# ---------------------------------------------------------------------------
# the virtual-time loop


@dataclass(slots=True)
class SimRun:
    """Outcome of one trace: when each request finished and how many tokens it got."""

    finish_time: dict[str, float] = field(default_factory=dict)  # request id -> virtual seconds
    output_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens streamed
    num_steps: int = 0
    virtual_seconds: float = 0.0


def simulate(scheduler, executor: SimExecutor, requests: list, on_step=None, max_steps: int = 10**8) -> SimRun:
    """Drive ``scheduler`` with ``executor`` over ``requests`` in virtual time.

    ``requests`` are ``GenerationRequest`` objects sorted by ``arrival_time``
    (seconds of virtual time). A request is added once the clock reaches its
    arrival; when nothing can run, the clock jumps to the next arrival.
    ``on_step(now, plan, seconds)`` is called after each plan is executed and
    before the scheduler sees the result, i.e. with the memory state of the step.
    """
    run = SimRun()
    now, i, n = 0.0, 0, len(requests)
    while i < n or len(run.finish_time) < n:
        while i < n and requests[i].arrival_time <= now:
            scheduler.add_request(requests[i])
            i += 1
        plan = scheduler.schedule()
        if plan is None or not plan.scheduled_seq_ids:
            if plan is not None:
                scheduler.update(executor.execute(plan))
            if i >= n:
                raise RuntimeError(f"simulation stalled: {n - len(run.finish_time)} requests never finish")
            now = max(now, requests[i].arrival_time)
            continue
        result = executor.execute(plan)
        if on_step is not None:
            on_step(now, plan, result.model_seconds)
        now += result.model_seconds
        run.num_steps += 1
        if run.num_steps > max_steps:
            raise RuntimeError(f"simulation exceeded {max_steps} steps")
        for upd in scheduler.update(result):
            if upd.error is not None:
                raise RuntimeError(f"request {upd.request_id} failed in simulation: {upd.error}")
            got = sum(len(s.new_token_ids) for s in upd.seqs)
            run.output_tokens[upd.request_id] = run.output_tokens.get(upd.request_id, 0) + got
            if upd.finished:
                run.finish_time[upd.request_id] = now
    run.virtual_seconds = now
    return run
