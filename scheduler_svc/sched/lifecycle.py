"""A scheduler's requests: intake, the one release path, migration, LoRA slot pins.

:class:`RequestLifecycle` holds the queues and the request/sequence indexes and
everything that adds or removes requests (queued, finished, aborted, failed
alone, taken away to another scheduler). The mixins that ``Scheduler`` is made
of all build on it: planning a step (``plan_building.py``, ``preemption.py``,
``admission.py``, ``scheduler.py``), applying its result (``result_handling.py``)
and the read-only counters and checks (``introspection.py``).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Collection, Mapping

import msgspec

from pagedserve.engine_api import ErrorKind, FinishReason, GenerationRequest, RequestUpdate
from pagedserve.kv_blocks import lora_key
from pagedserve.wire import MAX_SEED, LoraLoad, SamplingParams
from scheduler_svc.sched.in_flight import InFlight
from scheduler_svc.sched.kv_cache_manager import KVCacheManager, KVCacheManagerBase
from scheduler_svc.sched.lora_slots import LoraSlots
from scheduler_svc.sched.request import BeamState, MigratedRequest, Request, RequestState, Sequence
from scheduler_svc.sched.scheduler_config import SchedulerConfig

log = logging.getLogger(__name__)


class LoraUnloaded(ValueError):
    """A waiting request's LoRA adapter was unloaded: it fails with this message."""


class RequestLifecycle:
    """Queues and indexes of one scheduler, and every way a request enters or leaves."""

    def __init__(self, config: SchedulerConfig, num_device_blocks: int, num_cpu_blocks: int,
                 eos_token_ids: Collection[int], kv_manager: KVCacheManagerBase | None = None,
                 lora_paths: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv: KVCacheManagerBase = kv_manager or KVCacheManager(
            config.block_size, num_device_blocks, num_cpu_blocks, config.enable_prefix_caching)
        self._watermark = config.watermark_blocks(num_device_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival; the tail is the preemption victim
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}  # live sequences by seq_id
        self._next_seq_id = 0
        self._next_arrival = 0
        self._step_id = 0
        self._owed_frees: list[int] = []  # executor-resident seq ids to forget in the next plan
        self.in_flight: deque[InFlight] = deque()  # plans sent, oldest first (results come in order)
        self._stale_steps: set[int] = set()  # plans dropped by take_all_requests
        self._preempted = False  # set during one schedule() when someone was preempted
        self.num_preemptions = 0
        self.first_scheduled: list[GenerationRequest] = []  # admitted for the first time; the engine drains it
        self.failures: list[RequestUpdate] = []  # requests failed alone while scheduling; the engine drains it
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        # LoRA: the executor's adapter slots, and where each adapter the deployment serves lives (the
        # engine's registry: adapters loaded at run time appear in it).
        self.lora = LoraSlots(config.lora_slots)
        self.lora_paths: Mapping[str, str] = lora_paths if lora_paths is not None else {}

    # ------------------------------------------------------------------ requests in/out
    def add_request(self, req: GenerationRequest, resume: MigratedRequest | None = None) -> None:
        """Queue a request (``resume``: continue one taken from another scheduler)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already queued")
        self._validate(req, resume)
        p = req.params
        r = Request(req, self._next_arrival, eos_token_ids=frozenset() if p.ignore_eos else self.eos_token_ids,
                    stop_token_ids=frozenset(p.stop_token_ids), stop_len=self.max_total_tokens(req))
        self._next_arrival += 1
        if p.beam_width > 1:
            r.beam = BeamState(p.beam_width)
            sp = msgspec.structs.replace(p.sampling, beam_candidates=2 * p.beam_width, temperature=0.0)
            self.new_seq(r, 0, list(req.prompt_token_ids), sp)
        elif resume is not None and any(resume.outputs):
            self._resume_seqs(r, resume)
            if not r.live:
                for seq in r.seqs:
                    self.seqs.pop(seq.seq_id, None)
                raise ValueError(f"resume of {req.request_id!r}: every choice already finished")
        else:
            self.new_seq(r, 0, list(req.prompt_token_ids), p.sampling)
            r.forked = p.n == 1
        self.requests[req.request_id] = r
        self.waiting.append(r)

    def _validate(self, req: GenerationRequest, resume: MigratedRequest | None) -> None:
        reason = self.why_cannot_hold(req, resume)
        if reason is not None:
            raise ValueError(reason)

    def max_total_tokens(self, req: GenerationRequest) -> int:
        """The most tokens one of ``req``'s sequences reaches here (prompt and outputs)."""
        longest = len(req.prompt_token_ids) + req.params.max_tokens
        return min(longest, req.max_total_tokens or self.config.max_model_len)

    @property
    def usable_blocks(self) -> int:
        """The most KV blocks one request may ever hold here (the pool less the watermark)."""
        return self.kv.num_device_blocks - self._watermark

    def why_cannot_hold(self, req: GenerationRequest, resume: MigratedRequest | None = None) -> str | None:
        """Why this scheduler can never run ``req`` (too large for its executor) (its executor's length or pool), or None.

        It counts the whole length the request may reach (``max_total_tokens``, fixed when it was
        first placed) and, for a request taken from another executor (``resume``), the tokens it
        generated there: a request is never sent where it cannot finish as it would have."""
        cfg, n = self.config, len(req.prompt_token_ids)
        if n == 0:
            return "prompt_token_ids must not be empty"
        if n >= cfg.max_model_len:
            return f"prompt of {n} tokens must be shorter than max_model_len {cfg.max_model_len}"
        if req.params.max_tokens <= 0:
            return f"max_tokens must be positive, got {req.params.max_tokens}"
        if req.max_total_tokens is not None and req.max_total_tokens > cfg.max_model_len:
            return (f"the request may reach {req.max_total_tokens} tokens; this executor's max_model_len "
                    f"is {cfg.max_model_len}")
        if resume is not None:
            have = n + max((len(o) for o in resume.outputs), default=0)
            if have >= cfg.max_model_len:
                return (f"the request holds {have} tokens already; this executor's max_model_len "
                        f"is {cfg.max_model_len}")
        width = max(req.params.n, req.params.beam_width)
        if width > min(cfg.max_num_seqs, cfg.max_num_batched_tokens):
            return (f"n/beam_width {width} exceeds max_num_seqs {cfg.max_num_seqs} "
                    f"or max_num_batched_tokens {cfg.max_num_batched_tokens}")
        if req.lora and not self.lora.num_slots:
            return f"this executor serves no LoRA adapters (its --max-loras is 0); the request names {req.lora!r}"
        need = width * -(-self.max_total_tokens(req) // cfg.block_size)
        if need > self.usable_blocks:
            return f"request needs up to {need} KV blocks; this pool has {self.usable_blocks} usable"
        return None

    def new_seq(self, r: Request, index: int, tokens: list[int], sampling: SamplingParams) -> Sequence:
        seq = Sequence(self._next_seq_id, index, tokens, r.num_prompt_tokens, sampling, r)
        self._next_seq_id += 1
        r.seqs.append(seq)
        r.live.append(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def _resume_seqs(self, r: Request, m: MigratedRequest) -> None:
        p = r.req.params
        for i, out in enumerate(m.outputs):
            seq = self.new_seq(r, i, list(r.req.prompt_token_ids) + list(out), seeded(p.sampling, i))
            reason = m.finish_reasons[i] if i < len(m.finish_reasons) else None
            if reason is not None:
                seq.finish_reason = reason
                r.live.remove(seq)
                del self.seqs[seq.seq_id]
                r.emitted_seqs += 1

    def abort_request(self, request_id: str) -> None:
        """Drop a request now (idempotent); the next plan tells the executor."""
        r = self.requests.get(request_id)
        if r is not None:
            self.release_request(r, FinishReason.ABORTED)

    def finish_sequence(self, request_id: str, seq_index: int, reason: FinishReason) -> bool:
        """End one choice (a stop string matched). Returns True if the request is now done."""
        r = self.requests.get(request_id)
        if r is None:
            return True
        if r.beam is not None:
            raise ValueError("finish_sequence: beam search choices end only inside the scheduler")
        for seq in r.live:
            if seq.index == seq_index:
                self.finish_seq(seq, reason)
                break
        if not r.live and r.forked:
            self.release_request(r, None)
            return True
        return False

    def finish_seq(self, seq: Sequence, reason: FinishReason) -> None:
        """The one release path of a sequence (also used by preemption-free finishes)."""
        seq.finish_reason = reason
        self._forget(seq)
        seq.request.live.remove(seq)
        self.seqs.pop(seq.seq_id, None)

    def _forget(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.residency += 1
        if seq.resident:
            self._owed_frees.append(seq.seq_id)
        seq.forget_executor_state()

    def release_request(self, r: Request, reason: FinishReason | None) -> None:
        """Release every block of ``r`` and drop it from all queues (idempotent)."""
        if r.state is RequestState.FINISHED:
            return
        for seq in list(r.live):
            self.finish_seq(seq, reason or FinishReason.ABORTED)
        self.unpin_lora(r)
        if r.state is RequestState.RUNNING:
            self.running.remove(r)
        elif r.state is RequestState.WAITING:
            self.waiting.remove(r)
        elif r.state is RequestState.SWAPPED:
            self.swapped.remove(r)
        r.state = RequestState.FINISHED
        self.requests.pop(r.request_id, None)

    def fail_request(self, r: Request, exc: BaseException) -> RequestUpdate:
        """An exception while handling ``r`` fails ``r`` alone: it is released, the rest go on."""
        if isinstance(exc, LoraUnloaded):
            log.info("request %s: %s", r.request_id, exc)
        else:
            log.error("request %s failed inside the scheduler; failing it alone", r.request_id,
                      exc_info=(type(exc), exc, exc.__traceback__))
        self.release_request(r, FinishReason.ABORTED)
        if isinstance(exc, LoraUnloaded):  # (NOT_FOUND, as naming an adapter not served: no server fault)
            return RequestUpdate(r.request_id, [], True, r.num_prompt_tokens, r.num_cached_prompt_tokens,
                                 error=str(exc), error_kind=ErrorKind.NOT_FOUND)
        return RequestUpdate(r.request_id, [], True, r.num_prompt_tokens, r.num_cached_prompt_tokens,
                             error="internal error while scheduling it")  # (the detail is logged above)

    def take_all_requests(self) -> list[MigratedRequest]:
        """Remove every request and free all blocks; return what re-queues each elsewhere."""
        out = []
        for r in sorted(self.requests.values(), key=lambda r: r.arrival):
            n = r.req.params.n if r.beam is None else 0
            outputs: list[list[int]] = [[] for _ in range(n)]
            reasons: list[FinishReason | None] = [None] * n
            for seq in r.seqs if r.beam is None else ():
                outputs[seq.index] = seq.output_token_ids
                reasons[seq.index] = seq.finish_reason
            out.append(MigratedRequest(r.req, outputs, reasons))
            self.release_request(r, FinishReason.ABORTED)
        self._stale_steps.update(f.step_id for f in self.in_flight)
        self.in_flight.clear()
        return out

    def executor_reset(self) -> None:
        """The executor was told to forget every sequence (after ``take_all_requests``): the plans
        that call dropped get no answer here, and nothing it held needs freeing any more."""
        self._stale_steps.clear()
        self._owed_frees.clear()
        self.lora.reset()  # (it may have restarted: every adapter is loaded again when next used)

    def pin_lora(self, r: Request, loads: list) -> bool:
        """Give ``r``'s adapter a slot before it is admitted (a load for ``loads`` if the slot held
        another); False when every slot is pinned by other adapters. A base-model request: True."""
        key = lora_key(r.req.lora, r.req.lora_id)
        if key is None or r.lora_slot is not None:
            return True
        path = self.lora_paths.get(key)
        if path is None:
            raise LoraUnloaded(f"the LoRA adapter {r.req.lora!r} was unloaded before the request could start")
        got = self.lora.acquire(key)
        if got is None:
            return False
        r.lora_slot, load = got
        if load:
            loads.append(LoraLoad(r.lora_slot, key, path))
        return True

    def unpin_lora(self, r: Request) -> None:
        if r.lora_slot is not None:
            self.lora.release(r.lora_slot)
            r.lora_slot = None

    def _set_running(self, r: Request) -> None:
        r.state = RequestState.RUNNING
        if not self.running or self.running[-1].arrival < r.arrival:
            self.running.append(r)
        else:
            bisect.insort(self.running, r, key=lambda x: x.arrival)


def seeded(sp: SamplingParams, i: int) -> SamplingParams:
    """Choice i of a seeded n > 1 request samples with seed + i (mod 2**64: a seed is 64 bits)."""
    if i == 0 or sp.seed is None:
        return sp
    return sp.with_seed((sp.seed + i) & MAX_SEED)
