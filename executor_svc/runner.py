"""Apply plan deltas to per-sequence state, run one forward, sample: one step, in three phases.

The runner is the executor's whole per-step logic, independent of transport. It keeps each
resident sequence's tokens, block table and computed count (:class:`SeqState`), applies a plan
in the order documented in ``pagedserve/wire/messages.py``, packs the scheduled sequences' new
tokens into one batch (no padding, ``executor_svc/batch.py``), runs the model, samples where a
sequence's computed count reaches its token count, and appends the sampled token itself so the
scheduler can plan the next step without waiting.

One implementation of a step, in three phases: ``prepare`` (check, apply, build the batch),
``launch`` (start the forward) and ``complete`` (sample, report). Every step runs through them:
``execute`` runs them back to back, once per decode step of the plan (a plan of ``decode_steps``
k runs its steps 2..k as plans of their own); ``executor_svc/pipeline.py`` prepares a plan while
the step before it runs; the tensor-parallel runners hook into the phases (``_stepping``,
``_publish``, ``_guard``, ``_sample``, ``_sampled``).

Every plan gets exactly one answer (``StepResult``, whose docstring is the contract):

* a plan that does not fit the sequence state is **refused** whole, nothing of it applied, and
  so is every later plan until the scheduler resets the runner (``reset``);
* a step that cannot serve some sequences (the forward or the sampler raised, or a sequence's
  grammar cannot be served) **fails those**: they are dropped (``executor_svc/dropped.py``) and
  reported, the rest are served, and the runner serves on. If applying the plan itself raised,
  the state of what it named is unknown: those fail, and later plans are refused until a reset.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator

import torch

from executor_svc.attention import AttentionBackend
from executor_svc.batch import Batch, SeqState, build_batch
from executor_svc.decode_graphs import DecodeGraphs
from executor_svc.dropped import DroppedSeqs
from executor_svc.grammar import GrammarBackend, GrammarMasks
from executor_svc.kv_cache import KVCache
from executor_svc.lora.served import LoraOutcome, LoraSlotsOfRunner
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.plan_check import PlanChecker, PlanError
from executor_svc.sampler import Sampler
from executor_svc.seq_deltas import ExecutorDeltas
from executor_svc.speculative.draft import DraftModel
from executor_svc.speculative.plan import append_proposals, draft_into, with_draft_placeholders
from executor_svc.speculative.verify import speculating_rows
from executor_svc.step_report import report_greedy, sample_rows, sampling_logits, step_masks
from executor_svc.steps import LaunchedStep, PreparedStep, StepFatal
from executor_svc.token_chain import Chain, greedy_on_device, leave_out
from pagedserve.wire import MAX_TEXT_CHARS, BatchPlan, StepResult
from pagedserve.wire.plan_deltas import apply_deltas

log = logging.getLogger(__name__)
__all__ = ["Batch", "LaunchedStep", "ModelRunner", "PreparedStep", "SeqState", "StepFatal"]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 sampler: Sampler | None = None, max_model_len: int | None = None,
                 grammar: GrammarBackend | None = None) -> None:
        self.model, self.kv, self.backend = model, kv_cache, backend
        self.sampler = sampler or Sampler()
        self.grammar = grammar  # structured outputs (None: a follower rank, or no tokenizer.json)
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        self.checker = PlanChecker(kv_cache.num_blocks, kv_cache.num_cpu_blocks, kv_cache.block_size,
                                   model.cfg.vocab_size, self.max_model_len)
        self.seqs: dict[int, SeqState] = {}
        self.dropped = DroppedSeqs()  # failed sequences later plans may still name
        self.refusing: str | None = None  # why every plan is refused until reset() (None: serving)
        # The compute thread prepares each plan while the device runs the step before
        # (executor_svc/pipeline.py): on a GPU only, where that overlaps; tests set it on CPU.
        self.prepare_ahead = self.model.device.type == "cuda"
        # Decode steps one plan may ask for (BatchPlan.decode_steps), run back to back in execute():
        # in-order runners only (a plan prepared ahead needs its step's one token; tensor-parallel
        # followers take one step's tokens per plan, so their runners keep 1), announced in the
        # handshake. Where a step is short (small models on CPU) the per-plan cost is then paid once
        # for several tokens: the scheduler's, the link's, the executor's own.
        self.max_decode_steps = 1
        # Pure decode steps replayed from CUDA graphs (executor_svc/decode_graphs.py; None: eager).
        self.graphs: DecodeGraphs | None = None
        self.lora: LoraSlotsOfRunner | None = None  # LoRA adapters (--max-loras; executor_svc/lora/served.py)
        self.draft: DraftModel | None = None  # speculative decoding's draft model (--speculative-model)
        self.keep_logits = False  # tests: keep the last step's sampled logits rows in last_logits
        self.last_logits: torch.Tensor | None = None  # [num_sampled, vocab] float32

    def reset(self) -> None:
        """Forget every sequence and serve again (the scheduler re-sends what it wants)."""
        self.seqs.clear()
        self.dropped.clear()
        self.refusing = None
        if self.lora is not None:
            self.lora.reset()

    def decode_steps_served(self) -> int:
        """The most ``BatchPlan.decode_steps`` this runner serves: 1 when it prepares plans ahead."""
        return 1 if self.prepare_ahead else self.max_decode_steps

    def execute(self, plan: BatchPlan) -> StepResult:
        """One plan, start to end: the three phases back to back, once per decode step."""
        with self._stepping():
            result = self._in_order(plan)
            if plan.decode_steps > 1 and not result.refused and not result.failed_seq_ids:
                result = self._decode_more(plan, result)
            return result

    def _in_order(self, plan: BatchPlan, check: bool = True) -> StepResult:
        """The three phases back to back; the step's model_seconds include its preparation."""
        prepared = self.prepare(plan, check=check)
        if isinstance(prepared, StepResult):
            return prepared
        launched = self.launch(prepared)
        result = launched if isinstance(launched, StepResult) else self.complete(launched)
        result.model_seconds = time.perf_counter() - prepared.start
        return result

    def _decode_more(self, plan: BatchPlan, result: StepResult) -> StepResult:
        """Steps 2..k of a plan of ``decode_steps`` k: the sequences that sampled decode the token they
        sampled, and sample again, k - 1 times, each step a plan of its own (scheduled decodes, no
        deltas) through the three phases; their tokens follow the first step's in ``result``. The
        plan's check covered all k steps (the sequences sample plainly, their tables hold the k
        slots), so the steps are not checked again. A step that fails any sequence fails them all:
        their earlier tokens were appended here but are reported no more."""
        seq_ids = list(result.sampled_seq_ids)
        if not seq_ids:
            return result
        step = BatchPlan(plan.step_id, seq_ids, [1] * len(seq_ids))
        for _ in range(plan.decode_steps - 1):
            more = self._in_order(step, check=False)
            if more.refused or more.failed_seq_ids or more.sampled_seq_ids != seq_ids:
                self._drop(seq_ids)
                return StepResult(step_id=plan.step_id, failed_seq_ids=seq_ids,
                                  error=more.error or _text("executor error: a decode step sampled no token"))
            result.sampled_seq_ids += more.sampled_seq_ids
            result.sampled_token_ids += more.sampled_token_ids
            result.model_seconds += more.model_seconds
        return result

    def can_prepare_ahead(self, plan: BatchPlan) -> bool:
        """Whether ``plan`` may be prepared while the step before it is in flight: not when it
        copies or extends a sequence's tokens (forks, beam search's appended tokens, proposals),
        which would need that step's sampled token first."""
        return not plan.forks and not plan.append_tokens and not plan.proposals and not plan.draft_proposals

    def _build(self, plan: BatchPlan, in_flight: dict[int, SeqState] | None = None) -> Batch:
        """The plan's batch: each scheduled sequence's new tokens, a proposing one's proposals with
        them, and the rows verification reads."""
        num_new = plan.num_new_tokens
        if plan.proposals:
            extra = {p.seq_id: len(p.token_ids) for p in plan.proposals}
            num_new = [n + extra.get(sid, 0) for sid, n in zip(plan.scheduled_seq_ids, num_new, strict=True)]
        batch = build_batch(self.seqs, self.kv.block_size, self.model.device, plan.scheduled_seq_ids, num_new,
                            in_flight)
        if plan.proposals:
            batch.spec = speculating_rows(plan, batch, self.seqs)
            # (rows scored: each sequence's sampling row, and a speculating one's rows before it)
            batch.every_row_scored = (len(batch.logits_rows) + sum(len(p) for _, p, _ in batch.spec)
                                      == len(batch.token_ids))
        return batch

    # ---------------------------------------------------------------- the three phases

    def prepare(self, plan: BatchPlan, after: LaunchedStep | None = None, *,
                check: bool = True) -> PreparedStep | StepResult:
        """Check and apply ``plan`` and build its batch, on the host. ``after``: the step still in
        flight; the tokens it samples are inputs of this one, filled in by :meth:`launch`.
        ``check=False``: a further decode step of a plan whose check covered it."""
        start = time.perf_counter()
        if self.refusing is not None:
            return StepResult(step_id=plan.step_id, refused=True,
                              error=_text(f"discarded: a plan before it was refused ({self.refusing})"))
        if plan.draft_proposals:
            try:
                plan = with_draft_placeholders(plan, self.draft)
            except PlanError as exc:
                return self._refuse(plan, exc)
        sent, plan = plan, self.dropped.skip(plan)
        in_flight = after.sampling_seqs() if after is not None else {}
        if check and (refused := self._check(plan, in_flight)) is not None:
            return refused
        self._publish(sent)  # as sent: the other ranks skip what they dropped too (the frees of it included)
        try:
            with self._guard(f"applying plan {plan.step_id}"):
                self._apply(plan)
                if self.lora is not None and plan.lora_loads:
                    self._agree_lora(plan)
                lora = None
                if self.lora is not None and (self.lora.failed or plan.lora_loads):
                    plan, lora = self._lora_outcome(plan)
                append_proposals(plan, self.seqs)
                batch = self._build(plan, in_flight) if plan.scheduled_seq_ids else None
        except StepFatal:
            raise
        except Exception as exc:  # noqa: BLE001  the state of what it named is unknown: refuse until reset
            self.refusing = f"applying plan {plan.step_id} failed"
            return self._failure(plan, _named(plan), exc)
        return PreparedStep(plan, batch, start, lora)

    def launch(self, step: PreparedStep, tokens_on_device: bool = False) -> LaunchedStep | StepResult:
        """Start the forward of a prepared step (the step before it has completed by now).
        ``tokens_on_device``: take the step's tokens on the device where every row is greedy, so
        that the step after it can be launched before it completes (:meth:`launch_chained`)."""
        if self.dropped:
            self._refit(step)
        return self._launch(step, None, tokens_on_device)

    def launch_chained(self, step: PreparedStep, before: LaunchedStep) -> LaunchedStep | StepResult | None:
        """Start ``step`` before ``before`` (the step in flight) completes: its inputs that are
        ``before``'s tokens are filled on the device (token_chain.py). None where that cannot be
        (``before`` took no tokens on the device, a sequence was dropped since, a draft drafts):
        then ``before`` completes first and ``step`` is launched as usual."""
        if before.tokens is None or step.batch is None or self.dropped or (self.draft is not None and step.batch.spec):
            return None
        chain = Chain.of(step.batch, before.batch, before.tokens)  # (tokens were taken: before has a batch)
        return None if chain is None else self._launch(step, chain, True)

    def _launch(self, step: PreparedStep, chain: Chain | None, tokens_on_device: bool) -> LaunchedStep | StepResult:
        start = time.perf_counter()
        if step.batch is None:
            return LaunchedStep(step.plan, None, None, start, lora=step.lora)
        try:
            if chain is None:
                for row, seq, index in step.batch.in_flight_inputs:
                    if index >= len(seq.token_ids):
                        raise RuntimeError(f"seq {seq.seq_id}: the token the previous step was to sample is missing")
                    step.batch.token_ids[row] = seq.token_ids[index]
            with self._guard(f"the forward of step {step.plan.step_id}"):
                if self.draft is not None and step.batch.spec:
                    draft_into(self.draft, step.batch)
                logits = self._forward_batch(step.plan, step.batch, chain)
        except StepFatal:
            raise
        except Exception as exc:  # noqa: BLE001  its sequences fail; the runner serves on
            return self._lora_report(step.lora, self._failure(step.plan, step.plan.scheduled_seq_ids, exc))
        # The grammar masks are computed while the forward runs on the device (an error in one is
        # the sampler's: it fails the step's sampling rows, not the forward's).
        masks = step_masks(self.grammar, step.batch) if logits is not None else None
        launched = LaunchedStep(step.plan, step.batch, logits, start, masks, step.lora)
        if tokens_on_device and logits is not None:  # (a constrained row keeps the step on the host sampler)
            launched.tokens = greedy_on_device(step.batch, logits)
            if launched.tokens is not None and self.keep_logits:
                launched.logits = logits.clone()  # (a graph's output is rewritten by the step launched next)
        return launched

    def complete(self, step: LaunchedStep) -> StepResult:
        """Sample a launched step (waits for its forward) and report it."""
        result = StepResult(step_id=step.plan.step_id)
        batch = step.batch
        if batch is not None:
            result.prompt_logprobs = batch.prompt_scores
        if batch is not None and step.leave_out:
            leave_out(step)
        if batch is not None and batch.logits_rows:
            try:
                if step.tokens is not None:  # greedy, taken on the device at launch
                    self._report_device_tokens(step, result)
                else:
                    self._sample(batch, step.logits, result, step.masks)
            except StepFatal:
                raise
            except Exception as exc:  # noqa: BLE001  the sampling sequences fail; the runner serves on
                self._sampling_failed(batch)
                return self._lora_report(step.lora, self._failure(step.plan, [s.seq_id for s in batch.sample_seqs],
                                                                  exc))
            self._sampled(batch, result)
        result.model_seconds = time.perf_counter() - step.start
        return self._lora_report(step.lora, result)

    @staticmethod
    def _lora_report(lora: LoraOutcome | None, result: StepResult) -> StepResult:
        return result if lora is None else lora.report(result)

    # ---------------------------------------------------------------- hooks (tensor parallelism)

    def _stepping(self) -> contextlib.AbstractContextManager:
        """Around a whole plan run in order (rank 0 holds its channel for the step's messages)."""
        return contextlib.nullcontext()

    def _publish(self, plan: BatchPlan) -> None:
        """A plan passed its check and is about to be applied (rank 0 sends it to the other ranks)."""

    def _agree_lora(self, plan: BatchPlan) -> None:
        """After a plan's LoRA loads (tensor parallelism: a load that failed on any rank fails on all)."""

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Around applying a plan and the forward (ranks in lockstep make an error there fatal)."""
        yield

    def _sampled(self, batch: Batch, result: StepResult) -> None:
        """The step's tokens were appended (rank 0 sends them to the other ranks)."""

    def _sampling_failed(self, batch: Batch) -> None:
        """The sampler raised; nothing was appended (rank 0 tells the other ranks)."""

    # ---------------------------------------------------------------- refusals and failures

    def _check(self, plan: BatchPlan, in_flight: dict[int, SeqState]) -> StepResult | None:
        """The refusal of a plan that does not fit the sequences' state (None: it fits). A
        sequence of ``in_flight`` holds one token more: the one its step in flight samples."""
        try:
            self.checker.check(plan, {sid: (len(s.token_ids) + (in_flight.get(sid) is s), len(s.block_ids),
                                            s.num_computed_tokens) for sid, s in self.seqs.items()},
                               self.decode_steps_served())
            if plan.decode_steps > 1:
                self.checker.check_decoders(plan, self.seqs)
            if plan.proposals:
                self.checker.check_proposers(plan, self.seqs)
        except PlanError as exc:
            return self._refuse(plan, exc)
        return None

    def _refuse(self, plan: BatchPlan, exc: PlanError) -> StepResult:
        log.warning("refusing plan %d, and the plans after it until a reset: %s", plan.step_id, exc)
        self.refusing = f"plan {plan.step_id}: {exc}"
        return StepResult(step_id=plan.step_id, refused=True, error=_text(f"invalid plan: {exc}"),
                          failed_seq_ids=[] if exc.seq_id is None else [exc.seq_id])

    def _failure(self, plan: BatchPlan, seq_ids: Iterable[int], exc: Exception) -> StepResult:
        """A phase raised: these sequences are dropped and reported failed; the runner serves on."""
        failed = list(dict.fromkeys(seq_ids))
        log.error("step %d failed for %d sequences", plan.step_id, len(failed), exc_info=exc)
        self._drop(failed)
        return StepResult(step_id=plan.step_id, failed_seq_ids=failed,
                          error=_text(f"executor error: {type(exc).__name__}: {exc}"))

    def _drop(self, seq_ids: list[int]) -> None:
        """Forget these sequences; plans already sent may still name them (``executor_svc/dropped.py``)."""
        for sid in seq_ids:
            self.seqs.pop(sid, None)
        self.dropped.add(seq_ids)

    def _refit(self, step: PreparedStep) -> None:
        """A step before ``step`` failed after ``step`` was prepared: leave the sequences it dropped
        (and the children ``step`` forked from them) out of ``step``'s batch."""
        for child in self.dropped.fork_closure(step.plan):
            self.seqs.pop(child, None)
        if (plan := self.dropped.unscheduled(step.plan)) is not None:
            step.plan = plan
            # The step before has completed: every token of the sequences left is on the host now.
            step.batch = self._build(plan) if plan.scheduled_seq_ids else None

    def _apply(self, plan: BatchPlan) -> None:
        """The plan's deltas, in the documented order (the walk its check ran dry)."""
        apply_deltas(plan, self.seqs, ExecutorDeltas(self.kv, self.backend, self.grammar, self.lora, self.seqs,
                                                     self.draft.kv if self.draft is not None else None))

    def _lora_outcome(self, plan: BatchPlan) -> tuple[BatchPlan, LoraOutcome]:
        """``plan`` without the sequences under a slot whose adapter could not be loaded (dropped:
        never run by the base model in its place), and what its result reports of its loads."""
        doomed = self.lora.doomed(self.seqs)
        if doomed:
            self._drop(doomed)
        outcome = LoraOutcome(self.lora.take_failures(), [sid for sid in plan.scheduled_seq_ids if sid in doomed])
        return (self.dropped.skip(plan) if doomed else plan), outcome

    # ---------------------------------------------------------------- forward

    def _forward_batch(self, plan: BatchPlan, batch: Batch, chain: Chain | None = None) -> torch.Tensor | None:
        with torch.inference_mode():
            if self.graphs is not None and batch.lora_slots is None and self.graphs.serves(batch):
                logits = self.graphs.run(batch, chain)
            else:
                batch.place()
                input_ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=self.model.device)
                if chain is not None:
                    chain.fill(input_ids)
                with self.lora.batch(batch.lora_slots) if self.lora is not None else contextlib.nullcontext():
                    hidden, step_logits = self.model.forward_with_logits(input_ids, batch.positions, self.kv.layers,
                                                                         batch.meta, self.backend,
                                                                         batch.every_row_scored)
                    logits = self._logits(hidden, batch, step_logits)
        for sid, n in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True):
            self.seqs[sid].num_computed_tokens += n
        for s, first, _, count in batch.prompt_rows:  # (every rank: the next step's batch depends on it)
            s.prompt_lp_next = first + count
        return logits

    def _logits(self, hidden: torch.Tensor, batch: Batch, step_logits: torch.Tensor | None) -> torch.Tensor | None:
        """The sampling rows' logits (``step_report.sampling_logits``; tensor-parallel followers,
        which hold no LM head, have none)."""
        return sampling_logits(self.model, hidden, batch, step_logits)

    def _sample(self, batch: Batch, logits: torch.Tensor, result: StepResult,
                masks: GrammarMasks | None = None) -> None:
        if self.keep_logits:
            self.last_logits = logits.clone()
        if dropped := sample_rows(self.sampler, batch, logits, result, masks, self.grammar):
            self._drop(dropped)

    def _report_device_tokens(self, step: LaunchedStep, result: StepResult) -> None:
        if self.keep_logits:
            self.last_logits = step.logits
        report_greedy(step.batch, step.tokens.tolist(), result, self.grammar)

def _named(plan: BatchPlan) -> list[int]:
    """Every sequence a plan gives state to (scheduled, registered, forked, extended)."""
    return [*plan.scheduled_seq_ids, *(s.seq_id for s in plan.new_seqs), *(f.child_seq_id for f in plan.forks),
            *(u.seq_id for u in plan.block_updates), *(sid for sid, _ in plan.append_tokens)]


def _text(message: str) -> str:
    return message[:MAX_TEXT_CHARS]
