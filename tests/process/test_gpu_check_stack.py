"""gpu-check's whole-stack figure (testing/stack_throughput.py) on the CPU: a shaped model with its
word-level tokenizer served by real scheduler and executor processes, every stream delivering all
its tokens."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from testing import stack_throughput
from testing.shaped_models import SHAPES, write_shaped_llama, write_word_tokenizer


def test_the_word_tokenizer_covers_the_shaped_vocabulary(tmp_path):
    """Any id the random weights pick detokenizes, and the vocabulary is the model's."""
    vocab = SHAPES["test-shape"]["vocab_size"]
    tok = Tokenizer.from_file(str(write_word_tokenizer(tmp_path, vocab)))
    assert tok.get_vocab_size() == vocab
    assert tok.decode([3, 17, vocab - 1]) == f"w3 w17 w{vocab - 1}"
    assert tok.encode("w5 w6").ids == [5, 6]


def test_the_stack_streams_every_token_of_every_stream(tmp_path):
    model_dir = write_shaped_llama(tmp_path / "m", "test-shape", torch.float32)
    write_word_tokenizer(model_dir, SHAPES["test-shape"]["vocab_size"])
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = stack_throughput.measure(model_dir, ["--device", "cpu", "--dtype", "float32"], streams=(1, 3), tokens=6,
                                 prompt=10, reps=2, model_name="test-shape", logdir=logs)
    assert [r["streams"] for r in rows] == [1, 3]
    for r in rows:
        assert len(r["runs"]) == 2 and all(x > 0 for x in r["runs"])
        assert min(r["runs"]) <= r["tok_s"] <= max(r["runs"])

