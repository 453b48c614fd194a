"""Driving the executor's ModelRunner in tests: a CPU runner, the toy scheduler that hand-builds
its plans (``PlanDriver``, testing/plan_driver.py: the device checks use it too), the real
scheduler without a transport, transformers' references, and scenarios shared by parity tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.backends import make_attention_backend
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model
from executor_svc.runner import ModelRunner
from executor_svc.sampler import Sampler
from pagedserve.wire import BatchPlan, BlockUpdate, Fork, SamplingParams, StepResult
from testing.plan_driver import DriverSeq, PlanDriver


def make_runner(model_dir, num_blocks: int = 64, num_cpu_blocks: int = 16, block_size: int = 16,
                model=None, cpu_attention: str = "fused") -> ModelRunner:
    """A CPU runner; ``cpu_attention`` as the executor's flag (the fused kernel by default, as served)."""
    model = model if model is not None else load_model(model_dir)
    kv = KVCache(model.cfg, block_size, num_blocks, num_cpu_blocks, torch.float32)
    return ModelRunner(model, kv, make_attention_backend("cpu", cpu_attention), Sampler(seed=0))


def with_draft(runner: ModelRunner, draft_model, name: str = "draft", cpu_attention: str = "fused") -> ModelRunner:
    """``runner`` given a draft model (speculative decoding): its own pools with the runner's block counts."""
    from executor_svc.speculative.draft import DraftModel

    kv = runner.kv
    draft_kv = KVCache(draft_model.cfg, kv.block_size, kv.num_blocks, kv.num_cpu_blocks, torch.float32)
    runner.draft = DraftModel(draft_model, draft_kv, make_attention_backend("cpu", cpu_attention), runner.sampler, name)
    return runner


def drive(runner, sched, on_result: Callable[[BatchPlan, StepResult], None], max_steps: int = 1000) -> None:
    """The real Scheduler's plans run by ``runner`` with no transport until it has no work left;
    ``on_result(plan, result)`` takes each result into ``sched`` (and whatever the test keeps)."""
    for _ in range(max_steps):
        plan = sched.schedule()
        if plan is None:
            if not sched.has_work():
                return
            continue
        on_result(plan, runner.execute(plan))
    raise AssertionError("scheduler did not finish")


def serve_requests(runner, sched, reqs: dict, swaps: list[int] | None = None) -> dict[str, list[list[int]]]:
    """``reqs`` served to the end: request id -> choices' output tokens. ``swaps`` collects each
    plan's swap pair count."""
    out: dict[str, list[list[int]]] = {rid: [] for rid in reqs}
    for req in reqs.values():
        sched.add_request(req)

    def take(plan: BatchPlan, result: StepResult) -> None:
        if swaps is not None:
            swaps.append(len(plan.swap_out) + len(plan.swap_in))
        apply_result(sched, result, out)

    drive(runner, sched, take)
    return out


def apply_result(sched, result, out: dict[str, list[list[int]]]) -> None:
    """``result`` (which must not have failed) into ``sched``; each choice's new tokens into ``out``."""
    assert result.error is None, result.error
    for upd in sched.update(result):
        assert upd.error is None
        choices = out[upd.request_id]
        for s in upd.seqs:
            while len(choices) <= s.index:
                choices.append([])
            choices[s.index].extend(s.new_token_ids)
    sched.check_integrity()


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None  # never stop early: we compare fixed lengths
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


# ---------------------------------------------------------------- scenarios shared by the parity tests

def check_prefix_hit(runner, hf, first: list[int], suffix: list[int]) -> None:
    """A second sequence reuses the first's two full blocks (32 tokens) and computes only its suffix."""
    drv = PlanDriver(runner)
    drv.add(1, first)
    drv.run_until(1)
    second = first[:32] + suffix
    drv.add(2, second, computed=32, table=drv.seqs[1].table[:2])
    res = drv.step({2: 64})
    assert res.sampled_seq_ids == [2]
    drv.run_until(8, seq_ids=[2])
    assert drv.seqs[2].outputs == hf_greedy(hf, second, 8)


def check_swap_round_trip(runner, hf, prompt: list[int], pools: list, settle=lambda: None) -> None:
    """Swap a sequence out, overwrite its device blocks in every KV cache of ``pools`` (each
    rank's, under tensor parallelism: ``settle()`` first waits for every rank to have swapped),
    swap it back into other blocks: the output is unchanged."""
    drv = PlanDriver(runner)
    drv.add(1, prompt)
    drv.run_until(4)
    s = drv.seqs[1]
    cpu = list(range(len(s.table)))
    drv.step({}, swap_out=list(zip(s.table, cpu, strict=True)), free_seq_ids=[1])
    settle()
    for kv in pools:  # whatever ran on these blocks since: garbage
        for k, v in kv.layers:
            k[s.table] = 7.0
            v[s.table] = -7.0
    new_table = drv.alloc(len(s.table))
    drv.seqs.pop(1)
    drv.add(1, s.tokens, computed=s.computed, table=new_table, num_prompt=len(prompt))
    drv.seqs[1].outputs = s.outputs
    drv.step({1: 1}, swap_in=list(zip(cpu, new_table, strict=True)))
    drv.run_until(12)
    assert drv.seqs[1].outputs == hf_greedy(hf, prompt, 12)


def check_fork_with_copy_on_write(runner, hf, prompt: list[int], steps: int = 6) -> PlanDriver:
    """Beam candidates equal transformers' top 2; a fork of the sequence (its partly filled last
    block copied before the child writes) continues each candidate as greedy decoding would."""
    drv = PlanDriver(runner)
    drv.add(1, prompt, SamplingParams(temperature=0.0, beam_candidates=2))
    res = drv.step({1: 64})
    cand = res.beam_candidates[0]
    top = torch.topk(torch.log_softmax(hf_logits(hf, prompt)[-1], dim=-1), 2)
    assert cand.top_token_ids == top.indices.tolist()
    assert torch.allclose(torch.tensor(cand.top_logprobs), top.values, rtol=1e-4, atol=1e-5)
    assert res.sampled_seq_ids == []  # beam mode appends nothing itself
    parent = drv.seqs[1]
    child_block = drv.alloc(1)
    drv.seqs[2] = DriverSeq(list(parent.tokens), parent.num_prompt, parent.table[:-1] + child_block, parent.computed)
    c0, c1 = cand.top_token_ids
    for sid, tok in ((1, c0), (2, c1)):
        drv.seqs[sid].tokens.append(tok)
    res = drv.step({1: 1, 2: 1}, forks=[Fork(1, 2)], append_tokens=[(1, c0), (2, c1)],
                   block_updates=[BlockUpdate(2, len(parent.table) - 1, child_block)],
                   copies=[(parent.table[-1], child_block[0])])
    for _ in range(steps - 1):  # the "scheduler" appends each beam's best candidate: greedy
        appends = [(c.seq_id, c.top_token_ids[0]) for c in res.beam_candidates]
        for sid, tok in appends:
            drv.seqs[sid].tokens.append(tok)
        res = drv.step({1: 1, 2: 1}, append_tokens=appends)
    for sid, first in ((1, c0), (2, c1)):
        assert drv.seqs[sid].tokens[len(prompt) + 1:] == hf_greedy(hf, prompt + [first], steps - 1), sid
    return drv
