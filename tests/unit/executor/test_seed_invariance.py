"""A token's logits do not depend on how its step was made up (issue #43, default mode).

Seeded random mixes of requests run on a CPU-packed model through a small paged-cache
simulator: shared prefixes found again in a prefix cache (blocks written by prefills and by
decode steps alike), random chunk sizes, prefills beside other requests' decode tokens, pure
decode steps of several sequences (the fused decode stack), and preemptions that free a
request's blocks and recompute everything it had. Every logits row computed, of every prompt
and continuation token, must equal bit for bit the same request run alone (its prompt in one
prefill, then one decode step per token, on one thread), in every CPU weight format.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.backends import make_attention_backend
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model

BLOCK = 4  # small blocks: many full ones to share, many block boundaries inside chunks
FORMATS = {"float32": ({}, torch.float32), "bfloat16": ({"dtype": torch.bfloat16}, torch.bfloat16),
           "int8": ({"quantization": "int8"}, torch.float32),
           "Q4_1": ({"quantization": "gguf"}, torch.float32), "Q4_0": ({"quantization": "gguf"}, torch.float32)}


@dataclass
class Seq:
    tokens: list[int]  # prompt then continuation (teacher-forced: the same in every run)
    prompt_len: int
    table: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache
    fed: int = 0  # tokens admitted so far: the prompt, then one continuation token per step


class PagedRun:
    """A paged KV cache with a prefix cache by full-block token chains, driven step by step."""

    def __init__(self, model, kv_dtype: torch.dtype, num_blocks: int) -> None:
        self.model, self.backend = model, make_attention_backend("cpu", "fused")
        self.kv = KVCache(model.cfg, BLOCK, num_blocks, 0, kv_dtype)
        self.free = list(range(num_blocks))
        self.cached: dict[tuple[int, ...], int] = {}  # token chain of a full block -> its block
        self.by_decode: set[int] = set()  # cached blocks a one-token (decode) part completed
        self.admitted = self.hits = self.decode_hits = 0
        self.shapes: list[list[int]] = []  # new tokens per part, per step

    def admit(self, seq: Seq, use_cache: bool) -> None:
        """Take the longest chain of cached full blocks (leaving at least one token to compute)."""
        seq.table, seq.computed = [], 0
        while use_cache and (seq.computed + BLOCK) < seq.fed:
            block = self.cached.get(tuple(seq.tokens[:seq.computed + BLOCK]))
            if block is None:
                break
            seq.table.append(block)
            seq.computed += BLOCK
            self.hits += 1
            self.decode_hits += block in self.by_decode
        self.admitted += 1

    def release(self, seq: Seq) -> None:
        """Preemption: the blocks no chain holds go back; the request recomputes later."""
        kept = set(self.cached.values())
        self.free.extend(b for b in seq.table if b not in kept)
        seq.table, seq.computed = [], 0

    def step(self, parts: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Compute ``n`` more tokens of each (seq, n); the logits of every row computed, per part."""
        starts, slots, positions, ids = [0], [], [], []
        for seq, n in parts:
            while len(seq.table) * BLOCK < seq.computed + n:
                seq.table.append(self.free.pop())
            for pos in range(seq.computed, seq.computed + n):
                positions.append(pos)
                ids.append(seq.tokens[pos])
                slots.append(seq.table[pos // BLOCK] * BLOCK + pos % BLOCK)
            starts.append(starts[-1] + n)
        lens = [seq.computed + n for seq, n in parts]
        width = max(len(seq.table) for seq, _ in parts)
        tables = torch.tensor([seq.table + [0] * (width - len(seq.table)) for seq, _ in parts], dtype=torch.int32)
        meta = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), tables, max(n for _, n in parts), max(lens),
                                 starts, lens)
        self.shapes.append([n for _, n in parts])
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv.layers, meta, self.backend)
            logits = self.model.compute_logits(hidden)  # every row (prompt logprobs take them all)
        for seq, n in parts:  # full blocks join the prefix cache, whoever wrote them
            for b in range(seq.computed // BLOCK, (seq.computed + n) // BLOCK):
                if self.cached.setdefault(tuple(seq.tokens[:(b + 1) * BLOCK]), seq.table[b]) == seq.table[b] and n == 1:
                    self.by_decode.add(seq.table[b])
            seq.computed += n
        return [logits[starts[i]:starts[i + 1]] for i in range(len(parts))]


def alone(model, kv_dtype: torch.dtype, seq: Seq) -> torch.Tensor:
    """The reference: the prompt in one prefill, then one decode step per token, on one thread."""
    run, threads = PagedRun(model, kv_dtype, len(seq.tokens) // BLOCK + 2), torch.get_num_threads()
    seq = Seq(seq.tokens, seq.prompt_len)
    seq.fed = seq.prompt_len
    torch.set_num_threads(1)
    try:
        rows = run.step([(seq, seq.prompt_len)])
        for _ in range(len(seq.tokens) - seq.prompt_len):
            rows += run.step([(seq, 1)])
    finally:
        torch.set_num_threads(threads)
    return torch.cat(rows)


def requests(rng: random.Random, vocab: int) -> list[Seq]:
    shared = [rng.randrange(1, vocab) for _ in range(BLOCK * rng.randint(1, 4))]
    out = []
    for _ in range(rng.randint(3, 6)):
        head = shared[:BLOCK * rng.randint(0, len(shared) // BLOCK)] if rng.random() < 0.7 else []
        prompt = head + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))]
        out.append(Seq(prompt + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 10))], len(prompt)))
    if rng.random() < 0.5:  # a later turn of the same chat: the first request's continuation in its prompt
        first = out[0]
        prompt = first.tokens + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 8))]
        out.append(Seq(prompt + [rng.randrange(1, vocab) for _ in range(3)], len(prompt)))
    return out


def mix(model, kv_dtype: torch.dtype, seqs: list[Seq], rng: random.Random,
        use_cache: bool) -> tuple[dict[int, list], PagedRun]:
    """Random steps until every request is done; the logits rows computed, per request and position."""
    run = PagedRun(model, kv_dtype, sum(len(s.tokens) for s in seqs) // BLOCK + 4 * len(seqs) + 8)
    got: dict[int, list] = {i: [] for i in range(len(seqs))}
    waiting, running = list(range(len(seqs))), []
    while waiting or running:
        if waiting and (not running or rng.random() < 0.5):
            i = waiting.pop(0)
            seqs[i].fed = max(seqs[i].fed, seqs[i].prompt_len)
            run.admit(seqs[i], use_cache)
            running.append(i)
        if len(running) > 1 and rng.random() < 0.1:  # preempt the latest: recompute all it had
            i = running.pop()
            run.release(seqs[i])
            waiting.insert(0, i)
        budget, parts = rng.choice([1, 3, 8, 17, 64]), []
        for i in rng.sample(running, len(running)):
            seq = seqs[i]
            if seq.computed == seq.fed and seq.fed < len(seq.tokens):
                seq.fed += 1  # its next continuation token, as a decode step would
            n = min(seq.fed - seq.computed, budget)
            if n > 0:
                parts.append((i, n))
                budget -= n
        if parts:
            for (i, _), rows in zip(parts, run.step([(seqs[i], n) for i, n in parts]), strict=True):
                got[i].append((seqs[i].computed - rows.shape[0], rows))
        running = [i for i in running if seqs[i].computed < len(seqs[i].tokens)]
    return got, run


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v bias, tied embeddings
def test_logits_are_bit_identical_however_the_steps_were_made_up(tiny_checkpoint, tiny_gguf, fmt, arch):
    kwargs, kv_dtype = FORMATS[fmt]  # (Q4_*: a GGUF file's blocks, computed as stored)
    model = load_model(tiny_gguf(arch, fmt) if fmt.startswith("Q") else tiny_checkpoint(arch, "small"), **kwargs)
    assert model.decode_stack is not None  # the C kernels built: both CPU paths are exercised
    for trial in range(3):
        rng = random.Random(f"{fmt}-{arch}-{trial}")
        seqs = requests(rng, model.cfg.vocab_size)
        refs = [alone(model, kv_dtype, s) for s in seqs]
        for use_cache in (True, False):
            got, _ = mix(model, kv_dtype, [Seq(s.tokens, s.prompt_len) for s in seqs], rng, use_cache)
            for i, pieces in got.items():
                assert pieces, f"request {i} computed nothing"
                for start, rows in pieces:
                    ref = refs[i][start:start + rows.shape[0]]
                    assert torch.equal(rows, ref), (
                        f"trial {trial}, cache {use_cache}: request {i} positions {start}..{start + rows.shape[0]} "
                        f"differ by up to {float((rows - ref).abs().max())}")


def test_the_mixes_exercise_what_they_claim(tiny_llama_dir):
    """Over the seeds used above: cache hits (some on blocks decode steps wrote), preemptions,
    prefill chunks beside decode tokens, pure decode steps of several sequences."""
    model = load_model(tiny_llama_dir)
    runs, num_requests = [], 0
    for trial in range(3):
        rng = random.Random(f"float32-llama-{trial}")  # the draws of the test above
        seqs = requests(rng, model.cfg.vocab_size)
        num_requests += len(seqs)
        runs.append(mix(model, torch.float32, seqs, rng, use_cache=True)[1])
    assert sum(r.hits for r in runs) > 0
    assert sum(r.decode_hits for r in runs) > 0
    assert sum(r.admitted for r in runs) > num_requests  # someone was preempted and admitted again
    shapes = [s for r in runs for s in r.shapes]
    assert any(len(s) > 1 and max(s) > 1 and min(s) == 1 for s in shapes)  # a prefill beside a decode token
    assert any(len(s) > 1 and max(s) == 1 for s in shapes)  # a pure decode step of several sequences
