"""Teacher-forced top-1 agreement of the CPU weight formats with float32 transformers: the
measurement (``benchmarks/cpu_agreement.py`` runs it; the tests use its ``Forcer``).

transformers' float32 model generates ``--steps`` greedy tokens after each of ``--prompts``
random prompts (seeded by ``--seed``; tuning used seed 0, reported figures use other seeds).
Our model, loaded in each format, is then fed exactly those tokens (teacher forcing: its own
choices never feed back), all prompts as one decode batch, through the CPU fast path (the
fused decode stack, the KV cache in the format's dtype). At every step it is scored on
whether its top-1 token is the one transformers chose; the largest absolute logit difference
is reported too. ``prompts x steps`` decode steps in all (default 2,000). Float32 is included
as the reference point of the measurement itself, and ``transformers-bf16`` (transformers'
model in bfloat16, fed the same tokens) as the reference point of what bfloat16 costs.

The random-weight models' next-token distributions are nearly flat (logits spread ~2), so
rounding alone flips many choices, whatever the format's implementation. ``--train-steps N``
first trains the checkpoint (from its random weights) for N steps on the tiny model's corpus, so
that it predicts as a trained model does, with clear margins between its first choices; the
agreement is then measured on the trained weights, with the same random prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.backends import make_attention_backend
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model

FORMAT_ARGS = {"float32": {}, "bfloat16": {"dtype": torch.bfloat16}, "int8": {"quantization": "int8"}}
KV_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}
BLOCK = 16


@dataclass(slots=True)
class Agreement:
    fmt: str
    steps: int
    agree: int
    max_logit_diff: float

    @property
    def rate(self) -> float:
        return self.agree / self.steps


def reference(hf, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy tokens [P, steps], their logits [P, steps, vocab]) of transformers in float32. No
    end-of-sequence stops or is masked (a chat model's end of turn is scored like any token), and
    the attention mask is explicit (a pad id inside a prompt, SmolLM2's, is not masked)."""
    tokens, logits = [], []
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=steps, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(p):])
            logits.append(torch.stack(out.logits, dim=1)[0].float())
    return torch.stack(tokens), torch.stack(logits)


class Forcer:
    """Drives our model directly (no scheduler): prefill each prompt, then decode all at once."""

    def __init__(self, model, kv_dtype: torch.dtype, num_seqs: int, max_len: int, attention: str = "fused") -> None:
        """``attention="torch"``: the torch modules and attention instead of the fused decode stack."""
        self.model = model
        self.backend = make_attention_backend("cpu", attention)
        self.per_seq = -(-max_len // BLOCK)
        self.kv = KVCache(model.cfg, BLOCK, num_seqs * self.per_seq, 0, kv_dtype)
        self.lens = [0] * num_seqs

    def _meta(self, seqs: list[int], new: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        starts, slots, positions = [0], [], []
        for s, q in zip(seqs, new, strict=True):
            starts.append(starts[-1] + q)
            for pos in range(self.lens[s], self.lens[s] + q):
                positions.append(pos)
                slots.append((s * self.per_seq + pos // BLOCK) * BLOCK + pos % BLOCK)
            self.lens[s] += q
        lens = [self.lens[s] for s in seqs]
        tables = torch.tensor([list(range(s * self.per_seq, (s + 1) * self.per_seq)) for s in seqs], dtype=torch.int32)
        meta = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32), tables, max(new), max(lens), starts, lens)
        return meta, torch.tensor(positions)

    def step(self, seqs: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Feed ``tokens[i]`` to sequence ``seqs[i]``; logits [len(seqs), vocab] of each last token."""
        meta, positions = self._meta(seqs, [len(t) for t in tokens])
        ids = torch.tensor([t for ts in tokens for t in ts])
        with torch.inference_mode():
            hidden, logits = self.model.forward_with_logits(ids, positions, self.kv.layers, meta, self.backend)
            last = torch.tensor(meta.query_start_loc_host[1:]) - 1
            if logits is not None:  # (the fused decode step computed every row's)
                return logits.index_select(0, last)
            return self.model.compute_logits(hidden.index_select(0, last))


def measure(model_dir: Path, fmt: str, prompts: list[list[int]], ref_tokens: torch.Tensor,
            ref_logits: torch.Tensor) -> Agreement:
    return measure_model(load_model(model_dir, **FORMAT_ARGS[fmt]), fmt, KV_DTYPE[fmt], prompts, ref_tokens,
                         ref_logits)


def measure_model(model, fmt: str, kv_dtype: torch.dtype, prompts: list[list[int]], ref_tokens: torch.Tensor,
                  ref_logits: torch.Tensor) -> Agreement:
    """Our loaded ``model`` fed transformers' tokens, scored as ``fmt``."""
    steps = ref_tokens.shape[1]
    forcer = Forcer(model, kv_dtype, len(prompts), max(map(len, prompts)) + steps + 1)
    ours = [torch.stack([forcer.step([i], [p])[0] for i, p in enumerate(prompts)])]  # prefill: output 0
    for k in range(steps - 1):  # teacher forcing: transformers' token k is the input
        ours.append(forcer.step(list(range(len(prompts))), [[int(t)] for t in ref_tokens[:, k]]))
    logits = torch.stack(ours, dim=1)  # [P, steps, vocab]
    agree = int((logits.argmax(-1) == ref_tokens).sum())
    return Agreement(fmt, ref_tokens.numel(), agree, float((logits - ref_logits).abs().max()))


def measure_transformers_bf16(model_dir: Path, prompts: list[list[int]], ref_tokens: torch.Tensor,
                              ref_logits: torch.Tensor) -> Agreement:
    """The same score for transformers' own model in bfloat16 (weights and activations): the
    reference point of what bfloat16 costs on these models."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    return measure_transformers(hf, "transformers-bf16", prompts, ref_tokens, ref_logits)


def measure_transformers(hf, name: str, prompts: list[list[int]], ref_tokens: torch.Tensor,
                         ref_logits: torch.Tensor) -> Agreement:
    """The same score for a transformers model, each prompt and its reference tokens in one forward."""
    steps, agree, diff = ref_tokens.shape[1], 0, 0.0
    with torch.inference_mode():
        for p, toks, ref in zip(prompts, ref_tokens, ref_logits, strict=True):
            seq = torch.tensor([p + toks.tolist()])
            logits = hf(seq).logits[0, len(p) - 1:len(p) - 1 + steps].float()
            agree += int((logits.argmax(-1) == toks).sum())
            diff = max(diff, float((logits - ref).abs().max()))
    return Agreement(name, ref_tokens.numel(), agree, diff)


def train(model_dir: Path, out_dir: Path, steps: int, seed: int = 0, batch: int = 8, length: int = 128,
          lr: float = 1e-3) -> Path:
    """``model_dir`` trained for ``steps`` AdamW steps on ``batch`` random windows of ``length``
    tokens of the tiny model's corpus (gradient norm clipped at 1), saved to ``out_dir``."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from executor_svc.tiny_model import CORPUS

    ids = torch.tensor(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(CORPUS.read_text()).ids)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=g)
        x = torch.stack([ids[int(s):int(s) + length] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"training step {step}: loss {loss.item():.3f}", flush=True)
    model.eval().save_pretrained(out_dir)
    for f in model_dir.iterdir():  # the tokenizer and its configuration, as they were
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out_dir / f.name).write_bytes(f.read_bytes())
    return out_dir


def run(model_dir: Path, formats: list[str], num_prompts: int, steps: int, seed: int,
        prompt_lens: tuple[int, int] = (8, 64)) -> list[Agreement]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(*prompt_lens, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_prompts)]
    ref_tokens, ref_logits = reference(hf, prompts, steps)
    return [measure_transformers_bf16(model_dir, prompts, ref_tokens, ref_logits) if fmt == "transformers-bf16"
            else measure(model_dir, fmt, prompts, ref_tokens, ref_logits) for fmt in formats]
