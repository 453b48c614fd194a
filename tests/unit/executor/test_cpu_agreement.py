"""Teacher-forced agreement of the CPU weight formats with float32 transformers (the small test
model; benchmarks/cpu_agreement.py measures 2,000 steps on the default one, docs/PERF.md).

The random test models' next-token distributions are nearly flat (a median top-1/top-2 logit
gap of ~0.4, against logit spreads of ~2), so rounding the weights flips some choices: the
floors below are what these formats hold on this model with margin, well above what a wrong
kernel (a shifted scale, a dropped tail) would score, and float32 must agree exactly."""

from __future__ import annotations

from testing.cpu_agreement import run


def test_formats_agree_with_float32_transformers(tiny_llama_dir):
    results = {r.fmt: r for r in run(tiny_llama_dir, ["float32", "bfloat16", "int8"], 6, 30, seed=3)}
    assert results["float32"].rate == 1.0 and results["float32"].max_logit_diff < 1e-3
    assert results["bfloat16"].rate >= 0.90, results["bfloat16"]
    assert results["int8"].rate >= 0.80, results["int8"]
    assert results["bfloat16"].max_logit_diff < results["int8"].max_logit_diff


def test_training_the_test_model_teaches_it_the_corpus(tiny_llama_dir, tmp_path):
    """benchmarks/cpu_agreement.py --train-steps trains the checkpoint (its trained figures are of
    a model that predicts the corpus), and the trained one keeps the tokenizer."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from executor_svc.tiny_model import CORPUS
    from testing.cpu_agreement import train

    trained = train(tiny_llama_dir, tmp_path / "trained", steps=30, lr=3e-3)
    text = torch.tensor([Tokenizer.from_file(str(trained / "tokenizer.json")).encode(CORPUS.read_text()[:2000]).ids])

    def loss(model_dir) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            return float(model(input_ids=text, labels=text).loss)

    assert loss(trained) < loss(tiny_llama_dir) - 1.0
    assert (trained / "tokenizer.json").read_bytes() == (tiny_llama_dir / "tokenizer.json").read_bytes()
