"""PEFT adapters for the LoRA tests (executor_svc/lora): PEFT is the reference implementation.

``make_adapter`` builds a LoRA adapter with non-zero random weights (``init_lora_weights=False``:
an adapter we ignored would change nothing and pass unnoticed otherwise) on an HF checkpoint,
saves it in PEFT's format and returns transformers' model with the adapter merged
(``merge_and_unload``), whose logits ours must match. ``torch_model`` loads our model with plain
``nn.Linear`` layers on the CPU (the loader packs every float CPU model; CUDA models keep them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from executor_svc.lora.adapter import LoraAdapter, module_shape
from executor_svc.model import LlamaForCausalLM, load_model_config
from executor_svc.model.loader import _load_safetensors, _targets
from executor_svc.model.rope import RotaryEmbedding
from executor_svc.parallel.shard import NO_SHARD, TPShard


def make_adapter(base: Path, out: Path, targets: list[str], r: int = 8, alpha: float = 16,
                 rslora: bool = False, bf16: bool = False, seed: int = 0, **extra):
    """Save a PEFT adapter of ``base`` to ``out``; returns the merged float32 transformers model.
    ``bf16``: the file stores bfloat16 (the reference merges those rounded values)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                     use_rslora=rslora, lora_dropout=0.0, **extra)
    peft_model = get_peft_model(hf, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)  # PEFT's random B is small next to these weights: make every adapter count
                if bf16:
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
    peft_model.save_pretrained(out)
    if bf16:
        file = out / "adapter_model.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    return peft_model.merge_and_unload().eval()


def random_adapter(cfg, targets: list[str], r: int, seed: int) -> LoraAdapter:
    """An adapter's weights straight into memory (no PEFT: the GPU check installs none)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            out, n_in = module_shape(cfg, m)
            weights[layer, m] = (torch.randn(r, n_in, generator=g) / n_in ** 0.5, torch.randn(out, r, generator=g))
    return LoraAdapter(f"random-{seed}", r, 0.5, weights)


def torch_model(path: Path, shard: TPShard = NO_SHARD, reduce=None) -> LlamaForCausalLM:
    """Our float32 model on the CPU with nn.Linear layers and torch attention (not packed); with
    ``shard`` and ``reduce`` a tensor-parallel rank's, whose row-parallel layers take the torch path
    the CUDA ranks take (model/llama.py, ``_row_parallel``)."""
    cfg = load_model_config(path)
    local = shard.local_config(cfg) if shard.size > 1 else cfg
    model = LlamaForCausalLM(local, reduce, with_lm_head=shard.holds_lm_head).to_empty(device="cpu").to(torch.float32)
    _load_safetensors(path, _targets(cfg, shard), dict(model.named_parameters()))
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, torch.device("cpu"))
    return model.eval()


def forced_logits(model, manager, attention: str, slots: list[int], prompts: list[list[int]],
                  conts: list[list[int]]) -> torch.Tensor:
    """Our logits [seqs, 1 + steps, vocab] with sequence ``i`` on adapter slot ``slots[i]`` (-1: base):
    every prompt prefilled in one step, then ``conts`` fed one token per sequence per decode step
    (teacher forcing, the testing.cpu_agreement Forcer), each step inside ``manager.batch``."""
    from testing.cpu_agreement import Forcer

    seqs = list(range(len(prompts)))
    longest = max(len(p) + len(c) for p, c in zip(prompts, conts, strict=True))
    forcer = Forcer(model, torch.float32, len(prompts), longest + 1, attention)
    with manager.batch([s for s, p in zip(slots, prompts, strict=True) for _ in p]):
        rows = [forcer.step(seqs, prompts)]
    for k in range(len(conts[0])):
        with manager.batch(slots):
            rows.append(forcer.step(seqs, [[c[k]] for c in conts]))
    return torch.stack(rows, dim=1)



def greedy_tokens(stack, prompt: list[int], model: str | None, max_new: int) -> list[int]:
    """``prompt`` under adapter ``model`` (None: the base model) through a stack's gRPC API, greedy with
    ``max_new`` tokens, EOS ignored: the token ids (raises grpc.RpcError as the call does)."""
    from pagedserve.v1 import generation_pb2 as pb

    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=max_new, temperature=0.0, ignore_eos=True))
    if model is not None:
        req.model = model
    return [t for resp in stack.stub.Generate(req, timeout=120) for c in resp.choices for t in c.token_ids]


def served_greedy(stack, prompts: list[list[int]], names: list[str | None], max_new: int) -> dict:
    """Every prompt under every adapter name (None: the base model) at once, as :func:`greedy_tokens`:
    {(name, prompt index): token ids}."""
    import threading

    got, threads = {}, []
    for name in names:
        for i, prompt in enumerate(prompts):
            t = threading.Thread(target=lambda n=name, i=i, p=prompt: got.__setitem__(
                (n, i), greedy_tokens(stack, p, n, max_new)))
            threads.append(t)
            t.start()
    for t in threads:
        t.join()
    return got
