"""The runners of a tensor-parallel group: the leader behind the worker's interface, the followers.

Rank 0 (:class:`TensorParallelRunner`) is what the worker drives, through the same
``execute(plan) -> StepResult`` and ``reset()`` as a single-device ``ModelRunner``. It checks a
plan against its sequence state (a refused plan never leaves rank 0), sends it to the followers
(executor_svc/parallel/channel.py), and then every rank applies the same deltas to its own copy
of the sequence state and its own KV shard, and runs its shard of the forward; the row-parallel
layers' all-reduces keep the ranks in lockstep. Rank 0 alone computes logits and samples, then
sends the sampled tokens so each follower appends exactly what the leader appended (no rank
relies on drawing the same random numbers). A step that verified speculative (n-gram) proposals
sends, after those, the tokens each speculating sequence kept beyond its first, so every rank
takes back the same rejected proposals (a draft model is not served under tensor parallelism).

The step is ``ModelRunner``'s, in the same three phases, on every rank; the ranks only hook into
them. The leader holds the channel for a whole step (``_stepping``), sends the plan once it
passed its check (``_publish``) and the tokens once sampled (``_sampled``); a follower takes those
tokens where it would sample (``_sample``). On both, an error while applying a plan or in the
forward is fatal (``_guard``). Plans that name sequences an earlier step dropped reach the
followers already without them.

Failures: an exception while applying a plan or inside the forward leaves the ranks in different
places of the step, so it is fatal for the group (``TPGroup.fatal``: the process exits and the
scheduler migrates the requests). A failure in sampling, after the last collective, is not: the
followers are told, every rank drops the step's sampling sequences, nothing is appended anywhere,
and the step fails them as on one device.
"""

from __future__ import annotations

import threading
import time

import torch

from executor_svc.attention import AttentionBackend
from executor_svc.grammar import GrammarMasks
from executor_svc.kv_cache import KVCache
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.parallel.channel import DROPPED, FAILED, OK, PLAN, RESET, STOP, TICK, TICK_S, PlanChannel
from executor_svc.parallel.group import TPGroup
from executor_svc.runner import Batch, ModelRunner
from executor_svc.sampler import Sampler
from pagedserve import wire
from pagedserve.wire import BatchPlan, StepResult


def agree_lora_failures(runner: ModelRunner, group: TPGroup, plan: BatchPlan) -> None:
    """After a plan's LoRA loads, every rank learns which of them failed on any rank and fails them too:
    a slot loaded on some ranks only would run its sequences on some ranks and drop them on others,
    and the ranks' batches (and collectives) would part. Every rank calls this for the same plans."""
    slots = sorted({load.slot for load in plan.lora_loads})
    failed = torch.tensor([int(s in runner.lora.failed) for s in slots], dtype=torch.int64)
    group.control_max(failed)
    for slot, anywhere in zip(slots, failed.tolist(), strict=True):
        if anywhere and slot not in runner.lora.failed:
            runner.lora.mark_failed(slot, "the adapter could not be loaded on another tensor-parallel rank "
                                          "(its log says why)")


class TensorParallelRunner(ModelRunner):
    """Rank 0 of the group, for the worker exactly a ModelRunner."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, group: TPGroup,
                 sampler: Sampler | None = None, max_model_len: int | None = None) -> None:
        super().__init__(model, kv_cache, backend, sampler, max_model_len)
        self.prepare_ahead = False  # each step is one message sequence to the followers: in order
        self.group, self.channel = group, PlanChannel(group)
        self._lock = threading.Lock()  # one message sequence (a whole step) on the channel at a time
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="tp-ticker", daemon=True)
        self._ticker.start()

    def reset(self) -> None:
        with self._lock:
            self._send(RESET)
            super().reset()

    def _stepping(self) -> threading.Lock:
        return self._lock  # the whole step is one message sequence on the channel

    def _publish(self, plan: BatchPlan) -> None:
        self._send(PLAN, wire.encode(plan))  # checked here; the followers apply exactly this

    def _guard(self, what: str):
        return self.group.fatal_on_error(what)

    def _agree_lora(self, plan: BatchPlan) -> None:
        agree_lora_failures(self, self.group, plan)

    def _sampled(self, batch: Batch, result: StepResult) -> None:
        rows = batch.token_seqs()
        if len(result.sampled_token_ids) == len(rows):
            tokens = result.sampled_token_ids
        else:  # some rows failed alone (result.failed_seq_ids): DROPPED in their place
            sampled = dict(zip(result.sampled_seq_ids, result.sampled_token_ids, strict=True))
            tokens = [sampled.get(s.seq_id, DROPPED) for s in rows]
        self.channel.send_tokens(OK, tokens, len(rows))
        if batch.spec:  # what verification kept beyond each speculating sequence's first token
            emitted = {x.seq_id: x.token_ids for x in result.spec_tokens}
            self.channel.send_spec_tokens([emitted.get(s.seq_id, []) for s, _, _ in batch.spec],
                                          [len(props) for _, props, _ in batch.spec])

    def _sampling_failed(self, batch: Batch) -> None:
        self.channel.send_tokens(FAILED, [], len(batch.token_seqs()))  # the followers drop the same rows

    def _send(self, kind: int, payload: bytes = b"") -> None:
        self.channel.send(kind, payload)
        self._last_send = time.monotonic()

    def _tick(self) -> None:
        """Keep idle followers' wait for the next message under the collective timeout."""
        while not self._closed.wait(TICK_S / 4):
            if time.monotonic() - self._last_send < TICK_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed.is_set():
                    self._send(TICK)
            finally:
                self._lock.release()

    def close(self, timeout_s: float = 10.0) -> bool:
        """Tell the followers to exit; False when a step still held the channel after ``timeout_s``."""
        self._closed.set()
        self._ticker.join()
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            self._send(STOP)
        finally:
            self._lock.release()
        return True


class FollowerRunner(ModelRunner):
    """Ranks 1..N-1: the same sequence state and deltas as rank 0, their own shard, no sampling."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, group: TPGroup,
                 max_model_len: int | None = None) -> None:
        super().__init__(model, kv_cache, backend, Sampler(), max_model_len)
        self.group, self.channel = group, PlanChannel(group)

    def _logits(self, hidden: torch.Tensor, batch: Batch, step_logits: torch.Tensor | None) -> torch.Tensor | None:
        return None  # rank 0 holds the LM head and samples

    def _guard(self, what: str):
        return self.group.fatal_on_error(what)

    def _agree_lora(self, plan: BatchPlan) -> None:
        agree_lora_failures(self, self.group, plan)

    def _sample(self, batch: Batch, logits: torch.Tensor | None, result: StepResult,
                masks: GrammarMasks | None = None) -> None:
        """Append the tokens rank 0 sampled (and drop what it failed alone); rank 0's sampler
        failing is this step's sampling failure here too (``complete`` drops those sequences)."""
        rows = batch.token_seqs()
        tokens = self.channel.recv_tokens(len(rows))
        if tokens is None:
            raise RuntimeError("rank 0's sampler failed")
        for s, props, _ in batch.spec:  # back to the committed tokens, as verification does on rank 0
            del s.token_ids[len(s.token_ids) - len(props):]
            s.proposals = None
        dropped = [s.seq_id for s, tok in zip(rows, tokens, strict=True) if tok == DROPPED]
        for s, tok in zip(rows, tokens, strict=True):
            if tok != DROPPED:
                s.token_ids.append(tok)
        if batch.spec:  # then the tokens each speculating sequence kept after its first
            emitted = self.channel.recv_spec_tokens([len(props) for _, props, _ in batch.spec])
            for (s, _, _), toks in zip(batch.spec, emitted, strict=True):
                if s.seq_id not in dropped:
                    s.token_ids.extend(toks)
                    s.num_computed_tokens = len(s.token_ids) - 1  # (the verified tokens' K/V, as on rank 0)
        if dropped:  # they failed alone on rank 0
            self._drop(dropped)

    def _follow(self, plan: BatchPlan) -> None:
        """Run the step rank 0 is running, through the same phases."""
        result = self.execute(plan)
        if result.refused:  # rank 0 checked the same plan against the same state
            raise RuntimeError(f"step {plan.step_id} refused on a follower: {result.error}")

    def serve(self) -> None:
        """Follow the leader's messages until STOP (plans were checked on rank 0 against the
        same state; the bytes are decoded with the wire's bounded decoder all the same)."""
        while True:
            kind, payload = self.channel.recv()
            if kind == STOP:
                return
            if kind == RESET:
                self.reset()
            elif kind == PLAN:
                with self.group.fatal_on_error("following a plan"):
                    self._follow(wire.decode(payload, accept=(wire.BatchPlan,)))
