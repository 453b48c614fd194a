"""One simulated serving run: the real Scheduler, one allocator, one trace.

``run_trace`` builds a :class:`~scheduler_svc.sched.scheduler.Scheduler` whose only
difference between allocators is its KV manager (paged, or a contiguous Orca
baseline), drives it with :class:`SimExecutor` in virtual time, and returns
the statistics the paper's figures need (:class:`RunStats`).

Scheduler settings for every allocator (paper-like, documented in PERF.md):
block size 16, 983 device blocks (12 GiB / 800 KB per token, paper §6.1),
max_num_batched_tokens 2560 and max_num_seqs 256 (vLLM 0.1's defaults),
max_model_len 2048 (OPT), recompute preemption, no CPU swap space, no
automatic prefix caching (neither the 2023 vLLM nor Orca had it). The paged
run keeps the scheduler's default 1% free-block watermark (it protects
sequences that grow); contiguous chunks never grow, so the baselines use none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.bench.workloads import TraceRequest
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import BatchPlan, SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.sim.baseline_allocators import ContiguousKVCacheManager
from testing.sim.executor import BLOCK_SIZE, PAPER_NUM_BLOCKS, SimExecutor, simulate

ALLOCATORS = ("paged", "orca-oracle", "orca-pow2", "orca-max")
MEM_KINDS = ("token_states", "reservation", "internal_frag", "external_frag", "free")
MAX_MODEL_LEN = 2048
EOS_TOKEN_ID = 2  # OPT's </s>; the simulated executor never samples it


def make_scheduler(allocator: str, num_blocks: int = PAPER_NUM_BLOCKS, max_num_seqs: int = 256,
                   max_num_batched_tokens: int = 2560, space: str = "buddy") -> Scheduler:
    """The same Scheduler for every allocator; only the KV manager differs.

    ``space``: how the Orca baselines place their chunks ("buddy", the paper's §6.1, or "first-fit").
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    paged = allocator == "paged"
    cfg = SchedulerConfig(block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
                          preemption_mode="recompute", watermark=0.01 if paged else 0.0,
                          enable_prefix_caching=False)
    kv = None if paged else ContiguousKVCacheManager(allocator.removeprefix("orca-"), BLOCK_SIZE,
                                                     num_blocks, MAX_MODEL_LEN, space)
    return Scheduler(cfg, num_blocks, 0, (EOS_TOKEN_ID,), kv_manager=kv)


def to_requests(trace: list[TraceRequest], n: int = 1, beam_width: int = 1) -> list[GenerationRequest]:
    """GenerationRequests that stop after exactly each trace entry's output length (EOS ignored)."""
    out = []
    for t in trace:
        params = RequestParams(max_tokens=t.output_len, sampling=SamplingParams(temperature=1.0, seed=0),
                               n=n, beam_width=beam_width, ignore_eos=True)
        out.append(GenerationRequest(t.request_id, list(t.prompt_token_ids), params, t.arrival_time))
    return out


@dataclass(slots=True)
class RunStats:
    allocator: str
    workload: str
    rate: float
    num_requests: int
    norm_latency: float = 0.0  # mean over requests of (finish - arrival) / output tokens, s/token
    # Fig. 13: requests computed per step, averaged over the steps of the arrival window (each
    # iteration counts once: "average number of batched requests"), and the same weighted by
    # step time; prefill_steps: window steps that compute more than one token of some sequence.
    mean_batched: float = 0.0
    mean_batched_time: float = 0.0
    window_steps: int = 0
    prefill_steps: int = 0
    mem: dict[str, float] = field(default_factory=dict)  # MEM_KINDS -> time-averaged share of KV slots
    virtual_s: float = 0.0
    steps: int = 0
    preemptions: int = 0
    wall_s: float = 0.0


class MemoryProbe:
    """Time-weighted accounting of every KV slot into MEM_KINDS, per step.

    For each running sequence with ``R`` slots reserved for it (paged: its
    blocks; contiguous: what its policy asks for), ``A`` >= R slots it holds
    (contiguous: R rounded up by the allocator, a power of two for the buddy
    allocator), ``c`` slots holding token states (its computed tokens: the
    scheduler counts a step's tokens when it plans the step, so they include
    the step just executed) and ``F`` slots it will ever fill (prompt + output - 1:
    the last sampled token's K/V is never computed): token states = c,
    reservation = min(R, F) - c (filled later; for paging the unfilled part of
    the last block, "reserved for future generations", paper §4.2), internal
    fragmentation = R - min(R, F) (never filled: over-provisioning), external
    fragmentation = A - R (the allocator's rounding; the paper puts waste
    "from the memory allocator like the buddy allocator" there, §3.1). Free
    slots are external fragmentation too when a request is waiting and they
    lie in holes too small for its chunk (contiguous only: any free block
    serves a paged request); otherwise they are free. Steps after the last arrival (the
    drain) are left out of every average here (memory and batch size alike)
    so they describe the loaded system at the trace's rate.
    """

    def __init__(self, sched: Scheduler, until: float) -> None:
        self.sched, self.until = sched, until
        self.kv = sched.kv
        self.total_slots = self.kv.num_device_blocks * BLOCK_SIZE
        self.acc = dict.fromkeys(MEM_KINDS, 0.0)
        self.weight = 0.0  # seconds of the window
        self.steps = 0
        self.prefill_steps = 0
        self.batched_steps = 0.0  # sum over window steps of requests computed
        self.batched_time = 0.0  # the same, each step weighted by its seconds

    def __call__(self, now: float, plan: BatchPlan, seconds: float) -> None:
        if now > self.until:
            return
        n = len({self.sched.seqs[s].request.request_id for s in plan.scheduled_seq_ids if s in self.sched.seqs})
        self.steps += 1
        self.batched_steps += n
        self.batched_time += n * seconds
        self.prefill_steps += any(k > 1 for k in plan.num_new_tokens)
        token = reserv = internal = rounding = used = 0
        for r in self.sched.running:
            for seq in r.live:
                a, res = self._slots(seq)
                c = seq.num_computed_tokens
                if c > a:
                    raise RuntimeError(f"seq {seq.seq_id}: {c} token states in {a} slots")
                f = min(seq.num_prompt_tokens + r.req.params.max_tokens, MAX_MODEL_LEN) - 1
                token += c
                reserv += min(res, f) - c
                internal += res - min(res, f)
                rounding += a - res
                used += a
        free = self.total_slots - used
        ext = self._external(free)
        for k, v in zip(MEM_KINDS, (token, reserv, internal, rounding + ext, free - ext), strict=True):
            self.acc[k] += v * seconds
        self.weight += seconds

    def _slots(self, seq) -> tuple[int, int]:
        """(slots held, slots reserved by policy) of a running sequence."""
        if isinstance(self.kv, ContiguousKVCacheManager):
            chunk = self.kv.chunk(seq)
            return (chunk[1] * BLOCK_SIZE, self.kv.reserved_slots(seq)) if chunk else (0, 0)
        held = self.kv.num_blocks(seq) * BLOCK_SIZE
        return held, held

    def _external(self, free: int) -> int:
        if not isinstance(self.kv, ContiguousKVCacheManager) or not self.sched.waiting:
            return 0
        need = self.kv.chunk_blocks(self.sched.waiting[0].live[0])
        return sum(n for _, n in self.kv.space.holes() if n < need) * BLOCK_SIZE

    def shares(self) -> dict[str, float]:
        if self.weight == 0:
            return dict.fromkeys(MEM_KINDS, 0.0)
        return {k: v / (self.weight * self.total_slots) for k, v in self.acc.items()}


def run_trace(allocator: str, trace: list[TraceRequest], workload: str, rate: float,
              seed: int = 0, space: str = "buddy") -> RunStats:
    """Simulate ``trace`` end to end and summarise it."""
    t0 = time.perf_counter()
    sched = make_scheduler(allocator, space=space)
    probe = MemoryProbe(sched, until=trace[-1].arrival_time)
    run = simulate(sched, SimExecutor(seed=seed, eos_token_id=EOS_TOKEN_ID), to_requests(trace), probe)
    lat = []
    for t in trace:
        got = run.output_tokens.get(t.request_id, 0)
        if got != t.output_len:
            raise RuntimeError(f"{t.request_id} streamed {got} tokens, trace says {t.output_len}")
        lat.append((run.finish_time[t.request_id] - t.arrival_time) / t.output_len)
    sched.check_integrity()
    return RunStats(allocator, workload, rate, len(trace), norm_latency=sum(lat) / len(lat),
                    mean_batched=probe.batched_steps / probe.steps if probe.steps else 0.0,
                    mean_batched_time=probe.batched_time / probe.weight if probe.weight else 0.0,
                    window_steps=probe.steps, prefill_steps=probe.prefill_steps, mem=probe.shares(),
                    virtual_s=run.virtual_seconds, steps=run.num_steps, preemptions=sched.num_preemptions,
                    wall_s=time.perf_counter() - t0)
