"""A deterministic stand-in for an executor, strict about the plans it gets.

It keeps per-sequence state exactly as a real executor does from the plan
deltas (tokens, block table, computed count), applies a plan with the
executor's own walk (``pagedserve/wire/plan_deltas.py``, the order
``pagedserve/wire/messages.py`` documents), and simulates the KV cache: every slot a sequence computes stores a
fingerprint of (all tokens up to that position). Before a sequence computes
and after every step, every computed position of every sequence must read
back its own fingerprint through its block table — so a missing copy-on-write,
a wrong swap mapping, a bad prefix-cache hit or a block reused too early fails
the test instead of silently giving wrong attention.

"Sampling" is a hash of (seed, token ids so far) mod vocab: the same history
always gives the same token, so a request's output does not depend on
batching, preemption or pool size.

LoRA: with ``lora_slots`` it holds adapters in slots as the plans load them. A sequence's
fingerprints and samples then depend on its adapter's name too, so a prefix-cache hit across
adapters, or a sequence run under the wrong adapter, changes what it reads or emits; replacing an
adapter a live sequence uses is a plan error. ``failing_loras`` names adapters whose load fails.
"""

from __future__ import annotations

import math
import zlib
from array import array
from dataclasses import dataclass

from pagedserve import wire
from pagedserve.wire import BatchPlan, SamplingParams, SeqLogprobs, StepResult
from pagedserve.wire.messages import BlockUpdate, Fork, NewSeq
from pagedserve.wire.plan_deltas import DeltaError, DeltaTarget, Pairs, apply_deltas


class PlanError(AssertionError):
    """The plan is inconsistent with what the executor holds."""


@dataclass
class _Seq:
    tokens: list[int]
    num_prompt: int
    table: list[int]
    computed: int
    sampling: SamplingParams
    lora: str | None = None
    lora_slot: int = -1
    dropped: bool = False  # under a slot whose load failed: never computed again, only freed


def _h(*parts: int) -> int:
    return zlib.crc32(array("q", parts).tobytes())


def _salt(lora: str | None) -> list[int]:
    return [] if lora is None else [zlib.crc32(lora.encode()) + 1]


def fingerprints(tokens: list[int], lora: str | None = None) -> list[int]:
    out, prev = [], (_salt(lora) or [0])[0]
    for t in tokens:
        prev = _h(prev, t)
        out.append(prev)
    return out


def sample_token(seq_tokens: list[int], seed: int | None, vocab: int, lora: str | None = None) -> int:
    """The fake model: deterministic in (seed, adapter, history)."""
    return zlib.crc32(array("q", [seed or 0, *_salt(lora), *seq_tokens]).tobytes()) % vocab


LIKELY_TOKEN = 3


def model_logprobs(seq_tokens: list[int], vocab: int) -> list[float]:
    """The fake model's full next-token log-softmax, deterministic in the history."""
    base = zlib.crc32(array("q", seq_tokens).tobytes())
    logits = [(_h(base, v) % 100_000) / 10_000.0 for v in range(vocab)]
    logits[LIKELY_TOKEN % vocab] += 2.5  # so beam searches often meet EOS (tests use EOS = 3)
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def beam_candidates(seq_tokens: list[int], k: int, vocab: int) -> tuple[list[int], list[float]]:
    """The top k tokens of :func:`model_logprobs`, best first."""
    lps = model_logprobs(seq_tokens, vocab)
    toks = sorted(range(vocab), key=lambda t: lps[t], reverse=True)[:k]
    return toks, [lps[t] for t in toks]


class FakeExecutor:
    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 vocab_size: int = 64, through_wire: bool = True, check=None, lora_slots: int = 0,
                 failing_loras: frozenset[str] = frozenset()) -> None:
        self.check = check  # e.g. scheduler.check_integrity, run before every plan is applied
        self.bs = block_size
        self.vocab = vocab_size
        self.wire = through_wire
        self.dev: list[list[int | None]] = [[None] * block_size for _ in range(num_device_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.seqs: dict[int, _Seq] = {}
        self.steps = 0
        self.tokens_computed = 0
        self.max_batch_tokens = 0
        self.lora_slots: list[str | None] = [None] * lora_slots
        self.failing_loras = failing_loras
        self.failed_slots: dict[int, str] = {}  # slot -> why its last load failed
        self.lora_loads: list[tuple[int, str]] = []  # (slot, adapter) of every load, in order

    # ------------------------------------------------------------------ entry
    def run(self, plan: BatchPlan) -> StepResult:
        if self.check is not None:
            self.check()
        if self.wire:
            plan = wire.decode(wire.encode(plan))  # type: ignore[assignment]
        res = self._apply(plan)
        self.verify_all()
        self.steps += 1
        if self.wire:
            res = wire.decode(wire.encode(res))  # type: ignore[assignment]
        return res

    def _apply(self, plan: BatchPlan) -> StepResult:
        self._failures = []
        try:
            apply_deltas(plan, self.seqs, _FakeDeltas(self))
        except DeltaError as exc:  # (the walk's own rules: an unknown or already live sequence)
            raise PlanError(str(exc)) from exc
        for s in self.seqs.values():  # (as a real executor: sequences under a slot that failed to load)
            s.dropped = s.dropped or s.lora_slot in self.failed_slots
        res = self._forward(plan)
        res.lora_failures = self._failures
        return res

    def _load(self, x: wire.LoraLoad) -> None:
        if not 0 <= x.slot < len(self.lora_slots):
            raise PlanError(f"LoRA load into slot {x.slot}; the executor has {len(self.lora_slots)}")
        users = [sid for sid, s in self.seqs.items() if s.lora_slot == x.slot and not s.dropped]
        if users:
            raise PlanError(f"LoRA slot {x.slot} reloaded with {x.name!r} under live seqs {users}")
        self.lora_loads.append((x.slot, x.name))
        self.failed_slots.pop(x.slot, None)
        if x.name in self.failing_loras:
            self.lora_slots[x.slot] = None
            self.failed_slots[x.slot] = f"{x.path}: no such adapter"
            self._failures.append(wire.LoraFailure(x.slot, self.failed_slots[x.slot]))
        else:
            self.lora_slots[x.slot] = x.name

    def _forward(self, plan: BatchPlan) -> StepResult:
        if len(set(plan.scheduled_seq_ids)) != len(plan.scheduled_seq_ids):
            raise PlanError("a sequence is scheduled twice in one step")
        res = StepResult(plan.step_id)
        self.max_batch_tokens = max(self.max_batch_tokens, sum(plan.num_new_tokens))
        for sid, n in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True):
            s = self._seq(sid)
            if s.dropped:
                res.failed_seq_ids.append(sid)
                continue
            if s.lora_slot >= 0 and self.lora_slots[s.lora_slot] != s.lora:
                raise PlanError(f"seq {sid} runs under {s.lora!r}; its slot {s.lora_slot} holds "
                                f"{self.lora_slots[s.lora_slot]!r}")
            if n <= 0 or s.computed + n > len(s.tokens):
                raise PlanError(f"seq {sid}: {n} new tokens from {s.computed} of {len(s.tokens)}")
            if len(s.table) * self.bs < s.computed + n:
                raise PlanError(f"seq {sid}: table of {len(s.table)} blocks for {s.computed + n} tokens")
            fps = fingerprints(s.tokens[: s.computed + n], s.lora)
            self._check_context(sid, s, fps)
            for pos in range(s.computed, s.computed + n):
                self.dev[s.table[pos // self.bs]][pos % self.bs] = fps[pos]
            s.computed += n
            self.tokens_computed += n
            if s.computed == len(s.tokens):
                self._sample(sid, s, res)
        return res

    def _sample(self, sid: int, s: _Seq, res: StepResult) -> None:
        sp = s.sampling
        if sp.beam_candidates > 0:
            toks, lps = beam_candidates(s.tokens, sp.beam_candidates, self.vocab)
            res.beam_candidates.append(SeqLogprobs(sid, 0.0, toks, lps))
            return
        tok = sample_token(s.tokens, sp.seed, self.vocab, s.lora)
        s.tokens.append(tok)
        res.sampled_seq_ids.append(sid)
        res.sampled_token_ids.append(tok)
        if sp.want_logprobs:
            lp = -(_h(tok, len(s.tokens)) % 1000) / 100.0
            res.logprobs.append(SeqLogprobs(sid, lp, [tok], [lp]))

    # ------------------------------------------------------------------ checks
    def _check_context(self, sid: int, s: _Seq, fps: list[int]) -> None:
        for pos in range(s.computed):
            got = self.dev[s.table[pos // self.bs]][pos % self.bs]
            if got != fps[pos]:
                raise PlanError(f"seq {sid}: KV at position {pos} (block {s.table[pos // self.bs]}) "
                                f"is not this sequence's (stale, overwritten or never copied)")

    def verify_all(self) -> None:
        for sid, s in self.seqs.items():
            if s.computed and not s.dropped:
                self._check_context(sid, s, fingerprints(s.tokens[: s.computed], s.lora))

    def _seq(self, sid: int) -> _Seq:
        s = self.seqs.get(sid)
        if s is None:
            raise PlanError(f"unknown seq {sid}")
        return s

    def _dblk(self, b: int) -> int:
        if not 0 <= b < len(self.dev):
            raise PlanError(f"device block {b} out of range")
        return b

    def _cblk(self, b: int) -> int:
        if not 0 <= b < len(self.cpu):
            raise PlanError(f"CPU block {b} out of range")
        return b




class _FakeDeltas(DeltaTarget[_Seq]):
    """The deltas on the fake's state, strict: freeing an unknown sequence and naming a block
    outside the pools are errors, and every block move copies the simulated slots."""

    def __init__(self, ex: FakeExecutor) -> None:
        self.ex = ex

    def free_unknown(self, seq_id: int) -> None:
        raise PlanError(f"free of unknown seq {seq_id}")

    def load_lora(self, load: wire.LoraLoad) -> None:
        self.ex._load(load)

    def new_seq(self, ns: NewSeq) -> _Seq:
        for b in ns.block_ids:
            self.ex._dblk(b)
        lora = None
        if ns.lora_slot >= 0:
            if ns.lora_slot >= len(self.ex.lora_slots):
                raise PlanError(f"seq {ns.seq_id} under LoRA slot {ns.lora_slot}; the executor has "
                                f"{len(self.ex.lora_slots)}")
            lora = self.ex.lora_slots[ns.lora_slot]
            if lora is None and ns.lora_slot not in self.ex.failed_slots:
                raise PlanError(f"seq {ns.seq_id} under LoRA slot {ns.lora_slot}, which holds no adapter")
        return _Seq(ns.tokens(), ns.num_prompt_tokens, list(ns.block_ids), ns.num_computed_tokens, ns.sampling,
                    lora, ns.lora_slot)

    def fork(self, p: _Seq, f: Fork) -> _Seq:
        sp = p.sampling if f.seed is None else p.sampling.with_seed(f.seed)
        return _Seq(list(p.tokens), p.num_prompt, list(p.table), p.computed, sp, p.lora, p.lora_slot)

    def append_token(self, s: _Seq, seq_id: int, token: int) -> _Seq:
        s.tokens.append(token)
        return s

    def update_blocks(self, s: _Seq, u: BlockUpdate) -> _Seq:
        if not 0 <= u.start <= len(s.table):
            raise PlanError(f"block update of seq {u.seq_id} at {u.start}, table has {len(s.table)}")
        for b in u.block_ids:
            self.ex._dblk(b)
        s.table[u.start:] = u.block_ids
        return s

    def swap_out(self, pairs: Pairs) -> None:
        ex = self.ex
        for d, c in pairs:
            ex.cpu[ex._cblk(c)] = list(ex.dev[ex._dblk(d)])

    def swap_in(self, pairs: Pairs) -> None:
        ex = self.ex
        for c, d in pairs:
            ex.dev[ex._dblk(d)] = list(ex.cpu[ex._cblk(c)])

    def copy_blocks(self, pairs: Pairs) -> None:
        ex = self.ex
        for src, dst in pairs:
            ex.dev[ex._dblk(dst)] = list(ex.dev[ex._dblk(src)])


# Plans a driver keeps in flight: 1 = synchronous (plan, run, update); 2 = asynchronous
# scheduling (the next plan is built while one runs). Test modules parametrize it.
DEFAULT_DEPTH = 1


def drive(sched, ex: FakeExecutor, max_steps: int = 10_000, on_step=None,
          depth: int | None = None) -> dict[tuple[str, int], list[int]]:
    """Run a scheduler against ``ex`` until it has no work; check integrity every step.

    Returns every choice's tokens, keyed by (request_id, choice index), as
    reported through RequestUpdates (beam search: the final choices).
    ``on_step(plan, updates)`` is called after each step. With ``depth`` 2 the
    scheduler plans step k+1 before step k's result is applied, as the engine's
    asynchronous loop does; the executor still runs plans in order.
    """
    depth = depth or DEFAULT_DEPTH
    outs: dict[tuple[str, int], list[int]] = {}
    sent: list[BatchPlan] = []
    for _ in range(max_steps):
        while len(sent) < depth:
            plan = sched.schedule()
            sched.check_integrity()
            if plan is None:
                break
            sent.append(plan)
        if not sent:
            if not sched.has_work():
                return outs
            raise AssertionError("scheduler has work but produced no plan (stuck)")
        plan = sent.pop(0)
        updates = sched.update(ex.run(plan))
        sched.check_integrity()
        for u in updates:
            for su in u.seqs:
                outs.setdefault((u.request_id, su.index), []).extend(su.new_token_ids)
        if on_step is not None:
            on_step(plan, updates)
    raise AssertionError(f"not done after {max_steps} steps")
