"""gpu-check's executor sections (testing/kernels/executor_steps.py) on the CPU, on a small shape:
the code a leased GPU runs once, where a crash costs device time, runs here first. One loaded model
serves every section, as gpu-check hands it around."""

from __future__ import annotations

import pytest
import torch

from testing.kernels import executor_steps
from testing.shaped_models import write_shaped_llama


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    model_dir = write_shaped_llama(tmp_path_factory.mktemp("m") / "m", "test-shape", torch.float32, seed=5)
    return model_dir, executor_steps.load(model_dir, "cpu")


def test_decode_rows_graphs_off_and_on_from_one_loaded_model(shaped):
    model_dir, model = shaped
    rows = executor_steps.decode_steps(model_dir, model, "cpu", steps=2, prompt=16, seqs_list=(1, 3))
    assert [(r["seqs"], r["graphs"]) for r in rows] == [(1, False), (1, True), (3, False), (3, True)]
    assert all("error" not in r and r["wall_ms"] > 0 and r["busy_ms"] > 0 for r in rows), rows
    assert not {"forward_with_logits", "compute_logits"} & set(vars(model))  # the shared model is left as it was


def test_greedy_tokens_with_graphs_equal_the_eager_ones(shaped):
    model_dir, model = shaped
    assert executor_steps.graphs_greedy_equal(model_dir, model, "cpu", seqs=3, new_tokens=5) is True


def test_a_changed_graph_step_is_caught(shaped, monkeypatch):
    """The check can fail: a replayed bucket whose logits differ from the eager step's changes the tokens."""
    from executor_svc.decode_graphs import DecodeGraphs

    model_dir, model = shaped
    run = DecodeGraphs.run

    def off_by_one(self, batch, chain=None):
        logits = run(self, batch, chain)
        return logits.roll(1, dims=-1)  # every argmax moves to the next token id

    monkeypatch.setattr(DecodeGraphs, "run", off_by_one)
    assert executor_steps.graphs_greedy_equal(model_dir, model, "cpu", seqs=3, new_tokens=5) is False


def test_prefill_step_times_ours_and_transformers_on_the_same_tokens(shaped):
    model_dir, model = shaped
    row = executor_steps.prefill_step(model_dir, model, "cpu", seqs=2, tokens=32, reps=1)
    assert row["tokens"] == 64 and row["tok_s"] > 0 and row["hf_tok_s"] > 0
