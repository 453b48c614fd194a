"""Whether an executor's handshake is admitted: who it claims to be, and whether it fits the deployment.

The executor link's admission policy, apart from its transport (executor_link.py asks it, then
answers the handshake). Identity (:func:`identity_rejection`): an executor id stays bound to the
live connection that registered it, and a CURVE key must be admitted by the trust store
(executor_auth.py). Fit (:class:`ExecutorAdmission`): the wire version, block size, served model,
draft model, LoRA rank (an executor with adapter slots must take every rank the scheduler does) and,
with --batch-invariant, the numerics must agree with the scheduler's; what the
scheduler's own flags do not fix (the model when --model has no weights, its vocabulary size,
the numerics) is fixed by the first executor accepted.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve import wire
from scheduler_svc.engine.executor_auth import ExecutorAuth
from scheduler_svc.engine.executor_conn import ExecutorConn


def identity_rejection(conns: Iterable[ExecutorConn], trust: ExecutorAuth | None, identity: bytes,
                       key: bytes | None, hs: wire.Handshake) -> tuple[str | None, bool]:
    """Whether this connection may register as ``hs.executor_id``: its key must be admitted, and
    no other live connection may hold that id, whatever its routing id or key (the live executor
    keeps serving); ``conns``: the executors the hub holds. Returns (why not, or None; whether it
    enrolled)."""
    holder = next((c for c in conns if c.id == hs.executor_id and c.state != "dead"), None)
    if holder is not None and holder.identity != identity:
        return f"executor id {hs.executor_id!r} is held by another live connection", False
    if key is None:  # no CURVE: loopback only; the connection is the identity
        return None, False
    return trust.rejection(key, hs)


class ExecutorAdmission:
    """What an executor's handshake must agree with to join this deployment (one per hub)."""

    def __init__(self, block_size: int, *, model_fingerprint: str | None = None,
                 batch_invariant: bool = False) -> None:
        self.block_size = block_size
        # The served model: computed from the scheduler's own --model directory when its weights are
        # there; otherwise fixed by the first accepted executor.
        self.model_fingerprint = model_fingerprint
        self.model_vocab_size: int | None = None
        # --batch-invariant: only executors that promise it, all computing as the first one accepted does.
        self.batch_invariant = batch_invariant
        self.numerics: tuple[str, str, int] | None = None
        # Speculative decoding by a draft model: the draft every executor must hold (its name), or None:
        # then none may hold one (its blocks' memory would be spent on nothing).
        self.draft_model: str | None = None
        # LoRA: the highest adapter rank the scheduler accepts (--max-lora-rank with --enable-lora), or None.
        self.max_lora_rank: int | None = None

    def rejection(self, hs: wire.Handshake) -> str | None:
        """Why this executor cannot serve this deployment (None: it can)."""
        if hs.wire_version != wire.WIRE_VERSION:
            return f"wire version {hs.wire_version}, scheduler speaks {wire.WIRE_VERSION}"
        if hs.block_size != self.block_size:
            return f"block size {hs.block_size}, scheduler uses {self.block_size}"
        if hs.num_device_blocks < 1:
            return f"num_device_blocks must be >= 1, got {hs.num_device_blocks}"
        if self.model_fingerprint is not None and hs.model_fingerprint != self.model_fingerprint:
            return (f"model fingerprint {hs.model_fingerprint[:12]} differs from the served model's "
                    f"{self.model_fingerprint[:12]}")
        if self.model_vocab_size is not None and hs.vocab_size != self.model_vocab_size:
            return f"vocab size {hs.vocab_size} differs from the served model's {self.model_vocab_size}"
        if (reason := self._draft_rejection(hs)) is not None:
            return reason
        if self.max_lora_rank and hs.lora_slots and hs.max_lora_rank < self.max_lora_rank:
            # (an executor without slots is fine: requests naming an adapter are routed around it)
            return (f"its --max-lora-rank {hs.max_lora_rank} is below the scheduler's {self.max_lora_rank}: the "
                    f"adapters of higher rank the scheduler serves would fail on it")
        return self._variance(hs) if self.batch_invariant else None

    def _draft_rejection(self, hs: wire.Handshake) -> str | None:
        """Why this executor's draft model (or its lack of one) does not fit the scheduler's
        --speculative-config (None: it fits)."""
        if self.draft_model is None:
            if hs.draft_model:
                return (f"it holds draft model {hs.draft_model!r} (--speculative-model) and the scheduler's "
                        f"--speculative-config names no draft model")
            return None
        if not hs.draft_model:
            return (f"the scheduler's --speculative-config names draft model {self.draft_model!r} and this executor "
                    f"holds none (start it with --speculative-model)")
        if hs.draft_model != self.draft_model:
            return f"draft model {hs.draft_model!r}, the scheduler's --speculative-config names {self.draft_model!r}"
        if hs.draft_vocab_size != hs.vocab_size:
            return f"draft model {hs.draft_model!r} has a vocabulary of {hs.draft_vocab_size}, the model {hs.vocab_size}"
        if not hs.speculative:
            return f"draft model {hs.draft_model!r} on an executor that does not speculate"
        return None

    def _variance(self, hs: wire.Handshake) -> str | None:
        """Why this executor cannot serve a --batch-invariant deployment (None: it can): its results
        would depend on their batch, or it computes other bits than the executors already accepted
        (a request moved between them, after a failure or a drain, would change its log-probs)."""
        if not hs.batch_invariant:
            return ("the scheduler runs --batch-invariant and this executor's results depend on their batch "
                    "(its log says why: torch attention, or a CUDA device)")
        ours = (hs.numerics, hs.dtype, hs.tensor_parallel_size)
        if self.numerics is not None and ours != self.numerics:
            return (f"the scheduler runs --batch-invariant and this executor computes other bits than those "
                    f"accepted: {_describe(ours)}, not {_describe(self.numerics)}")
        return None

    def accepted(self, hs: wire.Handshake) -> None:
        """An executor joined: the first one fixes what the scheduler's flags left open."""
        self.model_fingerprint = self.model_fingerprint or hs.model_fingerprint
        self.model_vocab_size = self.model_vocab_size or hs.vocab_size
        if self.batch_invariant:
            self.numerics = self.numerics or (hs.numerics, hs.dtype, hs.tensor_parallel_size)


def _describe(numerics: tuple[str, str, int]) -> str:
    what, dtype, ranks = numerics
    return f"{what or 'unnamed numerics'} (KV {dtype}, {ranks} rank{'s' if ranks > 1 else ''})"
