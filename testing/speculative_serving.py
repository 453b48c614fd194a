"""Speculative decoding served by the real Scheduler and a given ModelRunner, with no transport: the
CPU tests (tests/unit/executor/test_speculative_serving.py) and the CUDA path's (tests/unit/kernels/
test_cuda_speculative.py) share it, so both check the same invariants after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import BatchPlan
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig
from testing.executor_plans import drive


class OracleProposer:
    """Proposes the true continuation (from a run without speculation), cut short and with a wrong
    token every third call, so whole acceptances, bonus tokens and rejections midway all occur."""

    def __init__(self, prompts: dict[str, list[int]], outputs: dict[str, list[list[int]]], k: int) -> None:
        self.k, self.calls = k, 0
        self.known = [(p, outputs[rid][0]) for rid, p in prompts.items()]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.calls += 1
        for prompt, cont in self.known:
            if tokens[:len(prompt)] == prompt:
                at = len(tokens) - len(prompt)
                out = list(cont[at:at + min(k, 1 + self.calls % self.k)])
                if out and self.calls % 3 == 0:
                    out[-1] = (out[-1] + 1) % 500
                return out
        return []


@dataclass
class Served:
    outputs: dict[str, list[list[int]]]  # request id -> each choice's tokens
    plans: list[BatchPlan]
    sched: Scheduler
    logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # (token, log-prob) per request
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)  # request id -> (ErrorKind, message)


def serve(runner, params: RequestParams, spec: SpeculativeConfig | None, prompts: dict[str, list[int]], *,
          num_cpu_blocks: int = 0, max_batched: int = 256, mode: str = "recompute", proposer=None,
          verified: int = 256, eos_token_ids: tuple[int, ...] = (), allow_errors: bool = False) -> Served:
    """``prompts`` served to the end with ``params``, speculating with ``spec`` (None: not); the
    scheduler's pools are the runner's. Every step must keep the scheduler's invariants, and at the
    end every block must be free and both sides must hold no sequence. A request that ends in error
    fails the call unless ``allow_errors`` (then its error is in ``Served.errors``)."""
    num_blocks = runner.kv.num_blocks
    cfg = SchedulerConfig(block_size=runner.kv.block_size, max_num_seqs=8, max_num_batched_tokens=max_batched,
                          max_model_len=256, speculative=spec, preemption_mode=mode)
    sched = Scheduler(cfg, num_blocks, num_cpu_blocks, eos_token_ids=eos_token_ids, vocab_size=runner.model.cfg.vocab_size)
    if spec is not None:  # (256: every sequence of these small batches speculates; the default is for CPU cost)
        sched.spec.policy.max_verified_tokens = verified
    if proposer is not None:
        sched.spec.proposer = proposer
    served = Served({rid: [] for rid in prompts}, [], sched, {rid: [] for rid in prompts})
    spec_usage: dict[str, tuple[int, int]] = {}  # the latest totals each request's updates carried
    for rid, p in prompts.items():
        sched.add_request(GenerationRequest(rid, p, params))

    def take(plan, result):
        served.plans.append(plan)
        for upd in sched.update(result):
            if upd.error is not None:
                assert allow_errors, upd.error
                served.errors[upd.request_id] = (upd.error_kind, upd.error)
            if upd.spec_proposed_tokens:
                assert upd.spec_accepted_tokens <= upd.spec_proposed_tokens
                assert upd.spec_proposed_tokens >= spec_usage.get(upd.request_id, (0, 0))[0]  # running totals
                spec_usage[upd.request_id] = (upd.spec_proposed_tokens, upd.spec_accepted_tokens)
            for s in upd.seqs:
                choices = served.outputs[upd.request_id]
                while len(choices) <= s.index:
                    choices.append([])
                choices[s.index].extend(s.new_token_ids)
                if s.logprobs:
                    served.logprobs[upd.request_id].extend((x.token_id, x.logprob) for x in s.logprobs)
        sched.check_integrity()

    drive(runner, sched, take)
    assert sched.kv.num_free_blocks == num_blocks  # nothing leaked
    assert not sched.requests and not runner.seqs
    if spec is not None:  # the requests' usage totals add up to the engine's counters
        assert sum(p for p, _ in spec_usage.values()) == sched.spec.counters.num_draft_tokens
        assert sum(a for _, a in spec_usage.values()) == sched.spec.counters.num_accepted_tokens
    else:
        assert not spec_usage
    return served
