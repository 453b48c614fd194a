"""LoRA delta on the CPU: grouped per-slot products (executor_svc/lora/apply.py) vs a per-token bmm.

``python -m benchmarks.lora_delta_cpu [--tokens 16] [--adapters 4] [--rank 16]``

At SmolLM2-135M's sizes (hidden 576, 9 q / 3 KV heads of 64, intermediate 1536), one decoder
layer's four projections: the delta of ``--tokens`` tokens spread over ``--adapters`` slots,
computed (a) as apply.py does, per slot ``(x_g A^T) B^T`` and ``index_add_``, and (b) by
gathering each token's A and B and two ``bmm``. Prints microseconds per layer for each, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from executor_svc.lora.apply import LoraBatch, add_delta
from executor_svc.lora.slots import FUSED, ProjectionSlots
from executor_svc.model.architecture import ModelConfig, RopeConfig

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64)


def _config() -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 49152, SMOLLM2["hidden_size"], SMOLLM2["intermediate_size"], 1,
                       SMOLLM2["num_heads"], SMOLLM2["num_kv_heads"], SMOLLM2["head_dim"], 1e-5,
                       RopeConfig(100000.0), 2048, True, False, False, "float32", (0,))


def _slots(cfg: ModelConfig, adapters: int, rank: int, max_rank: int) -> dict[str, ProjectionSlots]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (_, subs) in FUSED.items():
        p = ProjectionSlots.empty(cfg, subs, adapters, max_rank, torch.device("cpu"))
        for s in range(adapters):
            p.write(s, {m: (torch.randn(rank, p.a.shape[2], generator=g), torch.randn(n, rank, generator=g))
                        for m, (_, n) in p.subs.items()}, 0.5)
        out[name] = p
    return out


def _bmm(x: torch.Tensor, y: torch.Tensor, p: ProjectionSlots, token_slots: torch.Tensor) -> torch.Tensor:
    a, bt = p.a.index_select(0, token_slots), p.bt.index_select(0, token_slots)  # [n, R, in], [n, R, out]
    return y + torch.bmm(torch.bmm(x.unsqueeze(1), a.transpose(1, 2)), bt).squeeze(1)


def _time(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-rank", type=int, default=16, help="the slots' rank (>= --rank: padded)")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    cfg = _config()
    slots = _slots(cfg, args.adapters, args.rank, max(args.max_rank, args.rank))
    token_slots = torch.arange(args.tokens) % args.adapters
    batch = LoraBatch.build(token_slots, [True] * args.adapters, torch.device("cpu"))
    xs = {n: torch.randn(args.tokens, p.a.shape[2]) for n, p in slots.items()}
    ys = {n: torch.randn(args.tokens, p.bt.shape[2]) for n, p in slots.items()}
    for n, p in slots.items():  # the two agree
        torch.testing.assert_close(add_delta(xs[n], ys[n].clone(), p, batch),
                                   _bmm(xs[n], ys[n], p, token_slots), rtol=1e-4, atol=1e-3)
    grouped = _time(lambda: [add_delta(xs[n], ys[n].clone(), p, batch) for n, p in slots.items()], args.reps)
    per_token = _time(lambda: [_bmm(xs[n], ys[n].clone(), p, token_slots) for n, p in slots.items()], args.reps)
    print(f"{args.tokens} tokens, {args.adapters} adapters, r {args.rank}, {torch.get_num_threads()} threads, "
          f"per layer (4 projections): grouped {grouped:.0f} us, per-token bmm {per_token:.0f} us")
    print(json.dumps({"grouped_us": round(grouped, 1), "per_token_bmm_us": round(per_token, 1)}))


if __name__ == "__main__":
    main()
