"""Apply plan deltas to per-sequence state, run one forward, sample.

The runner is the executor's whole per-step logic, independent of transport:
``ModelRunner.execute(plan) -> StepResult``. It keeps each resident sequence's
tokens, block table and computed count (:class:`SeqState`), applies a plan in
the order documented in ``pagedserve/wire/messages.py``, packs the scheduled
sequences' new tokens into one batch (no padding), runs the model, samples
where a sequence's computed count reaches its token count, and appends the
sampled token itself so the scheduler can plan the next step without waiting.

The same step also runs in three phases, ``prepare`` (check, apply, build the
batch), ``launch`` (start the forward) and ``complete`` (sample, report), so that
``executor_svc/pipeline.py`` can prepare a plan while the step before it runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.kv_cache import KVCache
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.plan_check import PlanChecker, PlanError
from executor_svc.sampler import SampleOutput, Sampler
from pagedserve.wire import BatchPlan, SamplingParams, SeqLogprobs, StepResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqState:
    seq_id: int
    token_ids: list[int]  # prompt, then every output so far (sampled here or appended by the plan)
    num_prompt_tokens: int
    block_ids: list[int]  # logical block i -> physical block id
    num_computed_tokens: int  # tokens whose K/V are in the cache
    sampling: SamplingParams


@dataclass(slots=True)
class Batch:
    """One forward's inputs: the layout on the device, the token ids still on the host."""

    token_ids: list[int]  # [num_tokens]; copied to the device when the forward starts
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: list[int]  # rows of the packed tokens whose logits are sampled
    sample_seqs: list[SeqState]  # the sequence of each logits row (kept: a later plan may free it first)
    # Inputs that are tokens the step in flight samples (a plan prepared ahead): (row in
    # token_ids, sequence, index of the token in its token_ids once appended).
    in_flight_inputs: list[tuple[int, SeqState, int]] = field(default_factory=list)

    @property
    def sample_seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.sample_seqs]

    def token_seqs(self) -> list[SeqState]:
        """The sampling rows that get a token (beam rows report candidates and append nothing)."""
        return [s for s in self.sample_seqs if s.sampling.beam_candidates <= 0]


@dataclass(slots=True)
class PreparedStep:
    """A plan checked and applied, its batch built: what ``ModelRunner.launch`` starts."""

    plan: BatchPlan
    batch: Batch | None  # None: nothing scheduled


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward has been started (on a GPU it may still be running)."""

    plan: BatchPlan
    batch: Batch | None
    logits: torch.Tensor | None
    start: float  # when it was launched: its model_seconds run from here (its preparation overlapped)

    def sampling_seqs(self) -> dict[int, SeqState]:
        """The sequences that get a token when this step completes (beam rows get none)."""
        if self.batch is None or self.logits is None:
            return {}
        return {s.seq_id: s for s in self.batch.token_seqs()}


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 sampler: Sampler | None = None, max_model_len: int | None = None) -> None:
        self.model, self.kv, self.backend = model, kv_cache, backend
        self.sampler = sampler or Sampler()
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        self.checker = PlanChecker(kv_cache.num_blocks, kv_cache.num_cpu_blocks, kv_cache.block_size,
                                   model.cfg.vocab_size, self.max_model_len)
        self.seqs: dict[int, SeqState] = {}
        # The compute thread prepares each plan while the device runs the step before
        # (executor_svc/pipeline.py): on a GPU only, where that overlaps; tests set it on CPU.
        self.prepare_ahead = self.model.device.type == "cuda"
        self.keep_logits = False  # tests: keep the last step's sampled logits rows in last_logits
        self.last_logits: torch.Tensor | None = None  # [num_sampled, vocab] float32

    def reset(self) -> None:
        """Forget every sequence (after a reconnect the scheduler re-sends what it wants)."""
        self.seqs.clear()

    def execute(self, plan: BatchPlan) -> StepResult:
        start = time.perf_counter()
        if (refused := self._check(plan, {})) is not None:
            return refused
        try:
            result = self._step(plan)
        except Exception as exc:  # a failed step must not kill the executor; the scheduler fails it
            return _failed(plan, exc)
        result.model_seconds = time.perf_counter() - start
        return result

    def _check(self, plan: BatchPlan, in_flight: dict[int, SeqState]) -> StepResult | None:
        """The refusal of a plan that does not fit the sequences' state (None: it fits). A
        sequence of ``in_flight`` holds one token more: the one its step in flight samples."""
        try:
            self.checker.check(plan, {sid: (len(s.token_ids) + (in_flight.get(sid) is s), len(s.block_ids),
                                            s.num_computed_tokens) for sid, s in self.seqs.items()})
        except PlanError as exc:
            log.warning("step %d: refusing plan: %s", plan.step_id, exc)
            return StepResult(step_id=plan.step_id, error=f"invalid plan: {exc}")
        return None

    # ---------------------------------------------------------------- in phases (executor_svc/pipeline.py)

    def can_prepare_ahead(self, plan: BatchPlan) -> bool:
        """Whether ``plan`` may be prepared while the step before it is in flight: not when it
        copies or extends a sequence's tokens (forks, beam search's appended tokens), which
        would need that step's sampled token first."""
        return not plan.forks and not plan.append_tokens

    def prepare(self, plan: BatchPlan, after: LaunchedStep | None = None) -> PreparedStep | StepResult:
        """Check and apply ``plan`` and build its batch, on the host. ``after``: the step still in
        flight; the tokens it samples are inputs of this one, filled in by :meth:`launch`."""
        in_flight = after.sampling_seqs() if after is not None else {}
        if (refused := self._check(plan, in_flight)) is not None:
            return refused
        try:
            self._apply(plan)
            batch = (self.build_batch(plan.scheduled_seq_ids, plan.num_new_tokens, in_flight)
                     if plan.scheduled_seq_ids else None)
        except Exception as exc:  # noqa: BLE001  as in execute(): the step fails, the executor lives
            return _failed(plan, exc)
        return PreparedStep(plan, batch)

    def launch(self, step: PreparedStep) -> LaunchedStep | StepResult:
        """Start the forward of a prepared step (the step before it has completed by now)."""
        start = time.perf_counter()
        try:
            if step.batch is None:
                return LaunchedStep(step.plan, None, None, start)
            for row, seq, index in step.batch.in_flight_inputs:
                if index >= len(seq.token_ids):  # the step before failed: its token never came
                    raise RuntimeError(f"seq {seq.seq_id}: the token the previous step was to sample is missing")
                step.batch.token_ids[row] = seq.token_ids[index]
            logits = self._forward_batch(step.plan, step.batch)
        except Exception as exc:  # noqa: BLE001
            return _failed(step.plan, exc)
        return LaunchedStep(step.plan, step.batch, logits, start)

    def complete(self, step: LaunchedStep) -> StepResult:
        """Sample a launched step (waits for its forward) and report it."""
        result = StepResult(step_id=step.plan.step_id)
        try:
            if step.batch is not None and step.logits is not None:
                self._sample(step.batch, step.logits, result)
        except Exception as exc:  # noqa: BLE001
            return _failed(step.plan, exc)
        result.model_seconds = time.perf_counter() - step.start
        return result

    def _step(self, plan: BatchPlan) -> StepResult:
        """A checked plan: apply its deltas, forward, sample (tensor-parallel runners split this)."""
        self._apply(plan)
        return self._run(plan)

    # ---------------------------------------------------------------- deltas

    def _apply(self, plan: BatchPlan) -> None:
        self.backend.swap(self.kv.layers, self.kv.cpu_layers, plan.swap_out)
        for sid in plan.free_seq_ids:
            self.seqs.pop(sid, None)
        for s in plan.new_seqs:
            self.seqs[s.seq_id] = SeqState(s.seq_id, list(s.token_ids), s.num_prompt_tokens,
                                           list(s.block_ids), s.num_computed_tokens, s.sampling)
        for f in plan.forks:
            p = self.seqs[f.parent_seq_id]
            sampling = p.sampling if f.seed is None else p.sampling.with_seed(f.seed)
            self.seqs[f.child_seq_id] = SeqState(f.child_seq_id, list(p.token_ids), p.num_prompt_tokens,
                                                 list(p.block_ids), p.num_computed_tokens, sampling)
        for sid, tok in plan.append_tokens:
            self.seqs[sid].token_ids.append(tok)
        for u in plan.block_updates:
            table = self.seqs[u.seq_id].block_ids
            del table[u.start:]
            table.extend(u.block_ids)
        self.backend.swap(self.kv.cpu_layers, self.kv.layers, plan.swap_in)
        self.backend.copy_blocks(self.kv.layers, plan.copies)

    # ---------------------------------------------------------------- forward

    def _run(self, plan: BatchPlan) -> StepResult:
        result = StepResult(step_id=plan.step_id)
        batch, logits = self._forward(plan)
        if batch is not None and logits is not None:
            self._sample(batch, logits, result)
        return result

    def _forward(self, plan: BatchPlan) -> tuple[Batch | None, torch.Tensor | None]:
        """Run the scheduled tokens through the model and advance their computed counts; the
        batch (None when nothing is scheduled) and the logits of its sampling rows."""
        if not plan.scheduled_seq_ids:
            return None, None
        batch = self.build_batch(plan.scheduled_seq_ids, plan.num_new_tokens)
        return batch, self._forward_batch(plan, batch)

    def _forward_batch(self, plan: BatchPlan, batch: Batch) -> torch.Tensor | None:
        input_ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=self.model.device)
        with torch.inference_mode():
            hidden = self.model(input_ids, batch.positions, self.kv.layers, batch.meta, self.backend)
            logits = self._logits(hidden, batch)
        for sid, n in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True):
            self.seqs[sid].num_computed_tokens += n
        return logits

    def _logits(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """hidden [num_tokens, hidden] -> logits [num_sampling_rows, vocab] float32 (None if none)."""
        if not batch.logits_rows:
            return None
        rows = torch.tensor(batch.logits_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _sample(self, batch: Batch, logits: torch.Tensor, result: StepResult) -> None:
        if self.keep_logits:
            self.last_logits = logits.clone()
        seqs = batch.sample_seqs
        self._report(seqs, self.sampler.sample(logits, seqs), result)

    def build_batch(self, seq_ids: list[int], num_new: list[int], in_flight: dict[int, SeqState] | None = None
                    ) -> Batch:
        """One pass over the sequences gathers what only they know (their computed counts, new
        tokens and block tables); positions, slots and the padded tables are then computed for
        the whole batch at once. A decode step of 256 sequences costs the device's host thread
        a few hundred microseconds here instead of milliseconds (numpy calls per sequence).

        ``in_flight``: sequences whose next token a step still running samples; where it is an
        input, the row is left for ``launch`` to fill (``Batch.in_flight_inputs``)."""
        bs = self.kv.block_size
        seqs = self.seqs
        ids: list[int] = []
        begins: list[int] = []
        lens: list[int] = []
        blocks: list[int] = []  # every sequence's needed block ids, back to back
        blocks_per_seq: list[int] = []
        sample_at: list[int] = []  # batch index of each sampling sequence
        sample_seqs: list[SeqState] = []
        pending: list[tuple[int, SeqState, int]] = []
        for sid, n in zip(seq_ids, num_new, strict=True):
            s = seqs[sid]
            begin = s.num_computed_tokens
            end = begin + n
            tokens = s.token_ids
            known = len(tokens)
            length = known + 1 if in_flight and in_flight.get(sid) is s else known  # +1: being sampled
            if end - begin == 1 and end <= known:
                ids.append(tokens[begin])
            else:
                ids.extend(tokens[begin:end])
            if end > known:  # the token in flight is this step's last input: its row is filled at launch
                pending.append((len(ids), s, known))
                ids.append(0)
            nb = -(-end // bs)
            blocks.extend(s.block_ids[:nb])
            blocks_per_seq.append(nb)
            begins.append(begin)
            lens.append(end)
            if end == length:
                sample_at.append(len(lens) - 1)
                sample_seqs.append(s)
        num_seqs = len(lens)
        new = np.asarray(num_new, dtype=np.int64)
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(new, out=starts[1:])
        seq_of_token = np.repeat(np.arange(num_seqs), new)
        positions = np.asarray(begins, dtype=np.int64)[seq_of_token] + (np.arange(starts[-1]) - starts[seq_of_token])
        per_seq = np.asarray(blocks_per_seq, dtype=np.int64)
        first_block = np.zeros(num_seqs, dtype=np.int64)
        np.cumsum(per_seq[:-1], out=first_block[1:])
        block_tables = np.zeros((num_seqs, int(per_seq.max())), dtype=np.int32)
        seq_of_block = np.repeat(np.arange(num_seqs), per_seq)
        block_tables[seq_of_block, np.arange(len(blocks)) - first_block[seq_of_block]] = blocks
        slots = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        starts_host = starts.tolist()
        dev = self.model.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=max(num_new), max_seq_len=max(lens),
            query_start_loc_host=starts_host, seq_lens_host=lens)
        return Batch(ids, torch.from_numpy(positions).to(dev), meta, (starts[1:][sample_at] - 1).tolist(),
                     sample_seqs, pending)

    def _report(self, seqs: list[SeqState], out: SampleOutput, result: StepResult) -> None:
        for i, s in enumerate(seqs):  # every row checked before any is appended: all or nothing
            if out.beam[i] is None and out.token_ids[i] is None:
                raise RuntimeError(f"sampler returned no token for seq {s.seq_id}")
        for i, s in enumerate(seqs):
            beam = out.beam[i]
            if beam is not None:
                result.beam_candidates.append(SeqLogprobs(s.seq_id, 0.0, beam.top_token_ids, beam.top_logprobs))
                continue
            tok = out.token_ids[i]
            lp = out.logprobs[i]
            if lp is not None:
                result.logprobs.append(SeqLogprobs(s.seq_id, lp.token_logprob, lp.top_token_ids, lp.top_logprobs))
            s.token_ids.append(tok)
            result.sampled_seq_ids.append(s.seq_id)
            result.sampled_token_ids.append(tok)


def _failed(plan: BatchPlan, exc: Exception) -> StepResult:
    """A step that raised: reported as failed (the scheduler fails its requests), the executor lives."""
    log.exception("step %d failed", plan.step_id, exc_info=exc)
    return StepResult(step_id=plan.step_id, error=f"executor error: {type(exc).__name__}: {exc}")
