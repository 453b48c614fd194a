"""A toy scheduler that drives an executor runner with hand-built plans (tests and device checks).

``PlanDriver`` owns a free list of device blocks, sends a sequence's state once
(NewSeq), grows block tables with BlockUpdate, and mirrors what the executor
appends, exactly as the real scheduler's deltas would. The runner is anything with
``execute(plan) -> StepResult`` and a ``kv.block_size`` / ``kv.num_blocks``: a
ModelRunner, or rank 0 of a tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.wire import BatchPlan, BlockUpdate, NewSeq, SamplingParams, StepResult, pack_ids

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class DriverSeq:
    tokens: list[int]
    num_prompt: int
    table: list[int]
    computed: int
    outputs: list[int] = field(default_factory=list)


class PlanDriver:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.bs = runner.kv.block_size
        self.free = list(range(runner.kv.num_blocks - 1, -1, -1))
        self.seqs: dict[int, DriverSeq] = {}
        self.pending: list[NewSeq] = []
        self.step_id = 0

    def alloc(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def add(self, sid: int, tokens: list[int], sampling: SamplingParams = GREEDY, *, computed: int = 0,
            table: list[int] | None = None, num_prompt: int | None = None, lora_slot: int = -1) -> None:
        table = list(table) if table is not None else []
        need = -(-max(computed, 1) // self.bs)
        table += self.alloc(max(0, need - len(table)))
        num_prompt = len(tokens) if num_prompt is None else num_prompt
        self.seqs[sid] = DriverSeq(list(tokens), num_prompt, table, computed)
        self.pending.append(NewSeq(sid, pack_ids(tokens), num_prompt, list(table), computed, sampling,
                                   lora_slot=lora_slot))

    def step(self, schedule: dict[int, int], expect_ok: bool = True, **extra) -> StepResult:
        """schedule: seq_id -> new tokens (clipped to what remains). extra: other BatchPlan fields.
        ``expect_ok``: assert the result has no error (else the caller looks at it)."""
        updates = []
        ids, counts = [], []
        for sid, n in schedule.items():
            s = self.seqs[sid]
            n = min(n, len(s.tokens) - s.computed)
            need = -(-(s.computed + n) // self.bs) - len(s.table)
            if need > 0:
                new = self.alloc(need)
                updates.append(BlockUpdate(sid, len(s.table), new))
                s.table += new
            ids.append(sid)
            counts.append(n)
        plan = BatchPlan(self.step_id, ids, counts, new_seqs=self.pending,
                         block_updates=updates + extra.pop("block_updates", []), **extra)
        self.pending = []
        self.step_id += 1
        res = self.runner.execute(plan)
        assert res.error is None or not expect_ok, res.error
        for sid, n in zip(ids, counts, strict=True):
            if sid not in res.failed_seq_ids:
                self.seqs[sid].computed += n
        for sid, tok in zip(res.sampled_seq_ids, res.sampled_token_ids, strict=True):
            self.seqs[sid].tokens.append(tok)
            self.seqs[sid].outputs.append(tok)
        return res

    def run_until(self, max_new: int, chunk: int = 1 << 30, seq_ids: list[int] | None = None) -> None:
        """Prefill (in chunks of ``chunk``) and decode every listed sequence to ``max_new`` outputs."""
        seq_ids = list(self.seqs) if seq_ids is None else seq_ids
        while True:
            todo = {sid: chunk for sid in seq_ids if len(self.seqs[sid].outputs) < max_new}
            if not todo:
                return
            self.step(todo)
