"""What one maximum-size request costs an engine core's loop, piece by piece, in process.

Each piece is a stretch of the engine core's event loop that a single request makes long (the
longest of them bounds the plan delay ``tier_capacity --phases delay`` measures end to end):

- ``decode_submit``: the core decoding a front's ``Submit`` carrying 131,071 prompt token ids (ids
  drawn below a 128K vocabulary, as a Llama-3-sized model has; small ints are cached objects), packed;
- ``unpack_slice`` / ``unpack_total``: turning them into ints checked against the vocabulary, the
  longest of the front link's slices
  (``core_link.UNPACK_SLICE`` ids each, the loop free between) and all of them;
- ``admit_plan``: ``add_request`` and the first plan carrying the prompt (``schedule()`` and
  ``wire.encode``);
- ``chunk_max``: the longest of the steps prefilling it;
- ``finish``: releasing that request's 8K blocks (before its last chunk) (``abort_request``; a finish frees the same way);
- ``fork_n16``: with n = 16 on a 62K-token prompt, the plan that forks the 15 other choices from the
  computed prompt (``schedule()`` and ``wire.encode``);
- ``free_n16``: releasing those 16 choices (their 3.9K shared blocks each).

The scheduler runs with the engine's defaults (16-token blocks, 2,048-token chunks) over a pool of
65,536 blocks (``tier_processes.NUM_BLOCKS``), 64 decoding requests beside it. Each figure is
the median over ``--repeats`` runs of wall milliseconds (this is what delays a plan); the CPU
milliseconds of the same thread are printed beside it.

    .venv/bin/python -m benchmarks.max_request_costs [--repeats 5]

The last line printed is JSON with the median of each piece.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable

from benchmarks.scheduler_overhead import respond
from pagedserve import wire
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.kv_blocks import hash_blocks
from pagedserve.wire import SamplingParams
from pagedserve.wire import front_messages as m
from scheduler_svc.engine.front_link import UNPACK_SLICE, in_vocab
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.scheduler import Scheduler

EOS = 2
VOCAB = 128_256
MAX_MODEL_LEN = 131_072
NUM_BLOCKS = 1 << 16
BACKGROUND = 64


class _Clock:
    """Wall and thread-CPU milliseconds of the timed calls."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __call__(self, fn: Callable, *args):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*args)
        self.wall += (time.perf_counter() - t0) * 1e3
        self.cpu += (time.thread_time() - c0) * 1e3
        return out


def _request(rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> GenerationRequest:
    req = GenerationRequest(rid, prompt, RequestParams(max_tokens=max_tokens, n=n, ignore_eos=True,
                                                       sampling=SamplingParams(temperature=1.0, seed=7)))
    req.prompt_block_hashes = hash_blocks(None, prompt, 16)  # (the front hashes it)
    return req


def _scheduler(rng: random.Random) -> tuple[Scheduler, dict[int, int], dict[int, int]]:
    cfg = SchedulerConfig(max_model_len=MAX_MODEL_LEN)
    sched = Scheduler(cfg, NUM_BLOCKS, 0, (EOS,), vocab_size=VOCAB)
    for i in range(BACKGROUND):
        sched.add_request(_request(f"bg-{i}", [rng.randrange(VOCAB) for _ in range(64)], 1_000_000))
    tokens: dict[int, int] = {}
    computed: dict[int, int] = {}
    for _ in range(4):
        sched.update(respond(sched.schedule(), tokens, computed))  # type: ignore[arg-type]
    return sched, tokens, computed


def _step(sched: Scheduler, tokens: dict[int, int], computed: dict[int, int], clock: _Clock | None = None) -> None:
    def plan_and_encode():
        plan = sched.schedule()
        wire.encode(plan)  # type: ignore[arg-type]
        return plan

    plan = clock(plan_and_encode) if clock else plan_and_encode()
    sched.update(respond(plan, tokens, computed))  # type: ignore[arg-type]


def decode_submit(rng: random.Random) -> dict[str, tuple[float, float]]:
    """The frame's decode and the unpacking of its ids (the core's front link does it ``UNPACK_SLICE``
    ids per turn of its loop: ``unpack_slice`` is the longest turn, ``unpack_total`` all of them)."""
    prompt = [rng.randrange(VOCAB) for _ in range(MAX_MODEL_LEN - 1)]
    req = _request("front-0:big", [], 1)
    frame = m.TIER.encode(m.Submit(req, m.pack_ids(prompt), 0.0))
    clock = _Clock()
    msg = clock(m.TIER.decode, frame, m.FROM_FRONT, m.MAX_FRAME_BYTES)
    ids = clock(m.unpacked, msg.prompt_ids)
    total, longest, out = _Clock(), (0.0, 0.0), []
    for i in range(0, len(ids), UNPACK_SLICE):
        piece = _Clock()
        out += piece(lambda: in_vocab(ids[i:i + UNPACK_SLICE].tolist(), VOCAB, "prompt_token_ids", i))  # noqa: B023
        longest = max(longest, (piece.wall, piece.cpu))
        total.wall, total.cpu = total.wall + piece.wall, total.cpu + piece.cpu
    if out != prompt:
        raise RuntimeError("benchmark invariant: the prompt survives the round trip")
    return {"decode_submit": (clock.wall, clock.cpu), "unpack_slice": longest,
            "unpack_total": (total.wall, total.cpu)}


def long_prompt(rng: random.Random) -> dict[str, tuple[float, float]]:
    sched, tokens, computed = _scheduler(rng)
    req = _request("big", [rng.randrange(VOCAB) for _ in range(MAX_MODEL_LEN - 1)], 1)
    gc.collect()
    admit = _Clock()
    admit(sched.add_request, req)
    _step(sched, tokens, computed, admit)
    seq, chunk = sched.requests["big"].live[0], (0.0, 0.0)
    while seq.num_computed_tokens + 2048 < seq.num_prompt_tokens:  # its prefill but the last chunk
        clock = _Clock()
        _step(sched, tokens, computed, clock)
        chunk = max(chunk, (clock.wall, clock.cpu))
    gc.collect()
    finish = _Clock()
    finish(sched.abort_request, "big")
    sched.kv.check_integrity()
    return {"admit_plan": (admit.wall, admit.cpu), "chunk_max": chunk, "finish": (finish.wall, finish.cpu)}


def parallel_sampling(rng: random.Random) -> dict[str, tuple[float, float]]:
    sched, tokens, computed = _scheduler(rng)
    width = 16
    room = int(0.95 * NUM_BLOCKS) // width * 16
    req = _request("n16", [rng.randrange(VOCAB) for _ in range(min(MAX_MODEL_LEN, room) - 16)], 16, n=width)
    sched.add_request(req)
    r = sched.requests["n16"]
    while not r.forked:
        before = r.forked
        gc.collect()
        clock = _Clock()
        _step(sched, tokens, computed, clock)
        if r.forked and not before:
            fork = (clock.wall, clock.cpu)
    if len(r.live) != width:
        raise RuntimeError("benchmark invariant: every choice forked")
    sched.kv.check_integrity()
    gc.collect()
    free = _Clock()
    free(sched.abort_request, "n16")
    sched.kv.check_integrity()
    return {"fork_n16": fork, "free_n16": (free.wall, free.cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {}
    for i in range(a.repeats):
        rng = random.Random(i)
        for k, v in (decode_submit(rng) | long_prompt(rng) | parallel_sampling(rng)).items():
            runs.setdefault(k, []).append(v)
    out = {}
    for k, v in runs.items():
        wall = statistics.median(x[0] for x in v)
        cpu = statistics.median(x[1] for x in v)
        print(f"{k:>14}: {wall:7.2f} wall ms ({', '.join(f'{x[0]:.1f}' for x in v)}); {cpu:7.2f} CPU ms")
        out[f"{k}_ms"] = round(wall, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
