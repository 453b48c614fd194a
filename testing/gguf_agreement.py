"""Teacher-forced top-1 agreement of the block formats with float32 transformers on a GGUF
file's weights, beside what each format's rounding costs by itself (issue #38).

Reference: transformers loads the file (dequantizing it to float32: the weights W) and
generates ``steps`` greedy tokens after each of ``num_prompts`` real chat prompts (``CHATS``,
rendered with the file's chat template). For each format F the same tokens are fed (teacher
forcing) to

* ours: our model with W rounded as F, on the CPU kernels (the fused decode stack, every prompt
  one decode batch): the file itself for its own format (``--quantization gguf``: the blocks as
  stored), a copy of the file converted to F (``testing/gguf_convert.py``) for Q8_0, Q4_0 and
  Q4_K (Q4_K where a matrix's rows are whole super-blocks, float32 elsewhere: on SmolLM2, whose
  hidden size is 576, the MLP's down projections),
  and for ``int8`` W saved as safetensors and loaded with ``--quantization int8``;
* rounding: transformers in float32 on W rounded as F (the converted file; for int8 the Q8_0
  one, the same rounding): what the format itself costs, the activations kept float32.

Scored: the share of steps whose top-1 token is transformers' on W, and the largest logit
difference. The kernels may cost at most one point beyond the rounding. For the file's own
format the rounding is no rounding at all: there only the kernels can cost anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from executor_svc.model import load_model
from executor_svc.model.block_weights import block_format
from pagedserve.gguf_model import GGUFModel
from pagedserve.model_dir import load_tokenizer
from testing.cpu_agreement import Agreement, measure_model, measure_transformers, reference
from testing.gguf_convert import convert, to_safetensors

CHATS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "Give me three tips for learning Python.", "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.", "How do I make a cup of green tea?", "Why is the sky blue?",
    "What is the difference between a virus and a bacterium?", "Suggest a name for a small bakery.",
    "How many legs does a spider have?", "Translate 'good morning' into Spanish and German.",
    "What are the benefits of regular exercise?", "Describe a rainy day in three sentences.",
    "How does a refrigerator keep food cold?", "What should I pack for a weekend hiking trip?",
    "Explain what a prime number is.", "Write a short thank-you note to a teacher.",
    "Why do leaves change color in autumn?", "What is the tallest mountain in the world?",
]
FORMATS = ("q4_1", "q8_0", "q4_0", "q4_k", "int8")


@dataclass(slots=True)
class FormatAgreement:
    fmt: str
    ours: Agreement  # our kernels on W rounded as fmt
    rounding: Agreement  # transformers in float32 on the same rounded weights

    @property
    def kernel_cost(self) -> float:
        """Points of agreement the kernels lose beyond the format's rounding."""
        return 100 * (self.rounding.rate - self.ours.rate)


def chat_prompts(path: Path, n: int) -> list[list[int]]:
    """The first ``n`` of ``CHATS`` as one user turn each, rendered with the file's chat template."""
    from scheduler_svc.front.http.chat_template import load_chat_template

    template, tokenizer = load_chat_template(path), load_tokenizer(path)
    return [tokenizer.encode(template.render([{"role": "user", "content": c}]), add_special_tokens=False).ids
            for c in (CHATS * (n // len(CHATS) + 1))[:n]]


def own_format(path: Path) -> str | None:
    """The block format of the file's decoder matrices (its most common type), if one the kernels take."""
    types = [t.ggml_type for n, t in GGUFModel(path).file.tensors.items() if n.startswith("blk.") and len(t.shape) == 2]
    return block_format(max(set(types), key=types.count))


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def run(path: Path, formats: list[str], num_prompts: int, steps: int, tmp: Path) -> list[FormatAgreement]:
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"formats: {', '.join(FORMATS)}, got {', '.join(sorted(unknown))}")
    hf = _hf(path)
    prompts = chat_prompts(path, num_prompts)
    ref_tokens, ref_logits = reference(hf, prompts, steps)
    args = (prompts, ref_tokens, ref_logits)
    out = []
    for fmt in formats:
        qtype = Q.Q8_0 if fmt == "int8" else Q[fmt.upper()]
        if fmt == own_format(path):
            rounded, rounding = path, measure_transformers(hf, fmt, *args)
        else:
            rounded = convert(path, tmp / f"{qtype.name}.gguf", qtype)
            rounding = measure_transformers(_hf(rounded), fmt, *args)
        if fmt == "int8":  # float weights on safetensors, rounded by --quantization int8
            model = load_model(to_safetensors(path, tmp / "f32"), quantization="int8")
        else:
            model = load_model(rounded, quantization="gguf")
        out.append(FormatAgreement(fmt, measure_model(model, fmt, torch.float32, *args), rounding))
    return out
