"""GGUF files as --model: every supported format gives transformers' greedy output, token for
token (float32); the tokenizer and template come from the file; bad files fail at open, naming why."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from executor_svc.config import parse_config
from executor_svc.model import load_model, load_model_config
from executor_svc.model.gguf_weights import gguf_tensors, unpermute
from pagedserve.gguf_file import GGUFError
from pagedserve.gguf_model import GGUFModel, llama3_factors
from pagedserve.gguf_tokenizer import build_tokenizer
from pagedserve.model_dir import eos_token_ids, has_model_config, is_gguf, resolve_model
from pagedserve.wire.fingerprint import model_fingerprint
from testing.executor_plans import PlanDriver, hf_greedy, make_runner
from testing.gguf_files import llama_permute, sentencepiece_vocab, write_gguf

FORMATS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q5_K]


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ours(path, prompts: dict[int, list[int]], n: int) -> dict[int, list[int]]:
    drv = PlanDriver(make_runner(path, model=load_model(path)))
    for sid, p in prompts.items():
        drv.add(sid, p)
    drv.run_until(n)
    return {sid: drv.seqs[sid].outputs[:n] for sid in prompts}


@pytest.mark.parametrize("arch,qtype,tied", [("llama", t, False) for t in FORMATS]
                         + [("llama", Q.Q4_K, True), ("qwen2", Q.Q8_0, True), ("qwen2", Q.Q6_K, False)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_greedy_equals_transformers_loading_the_same_file(tmp_path, tiny_llama_dir, arch, qtype, tied):
    path = write_gguf(tmp_path / f"m-{qtype.name}.gguf", tiny_llama_dir, arch, qtype, tied=tied)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    vocab = load_model_config(path).vocab_size
    prompts = {0: _prompt(9, 1, vocab), 1: _prompt(23, 2, vocab)}
    ours = _ours(path, prompts, 24)
    for sid, p in prompts.items():
        assert ours[sid] == hf_greedy(hf, p, 24), (arch, qtype.name, sid)


def test_q_and_k_rows_are_unpermuted(tmp_path, tiny_llama_dir):
    """llama.cpp interleaves each head's rotary halves; the loader gives HF's order back (the
    equality above would fail without it)."""
    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir, "llama", Q.F32)
    gguf = GGUFModel(path)
    [(_, q)] = gguf_tensors(gguf, {"model.layers.0.self_attn.q_proj.weight"})
    stored = torch.from_numpy(gguf.file.raw("blk.0.attn_q.weight").copy())
    half = gguf.config["head_dim"] // 2
    assert not torch.equal(q, stored)
    assert torch.equal(q[0], stored[0]) and torch.equal(q[half], stored[1]) and torch.equal(q[1], stored[2])
    x = np.arange(4 * 6 * 3, dtype=np.float32).reshape(24, 3)
    assert np.array_equal(unpermute(llama_permute(x, 4), 4), x)


def test_metadata_is_what_the_services_read(tmp_path, tiny_llama_dir):
    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir, "llama", Q.Q8_0)
    assert is_gguf(path) and has_model_config(path) and not is_gguf(tiny_llama_dir)
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (
        "LlamaForCausalLM", 256, 4, 2, 2)
    expected_eos = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")).token_to_id("<|endoftext|>")
    assert eos_token_ids(path) == (expected_eos,)
    other = write_gguf(tmp_path / "other.gguf", tiny_llama_dir, "llama", Q.Q8_0, seed=1)
    assert model_fingerprint(path) == GGUFModel(path).fingerprint()
    assert model_fingerprint(path) != model_fingerprint(write_gguf(tmp_path / "q4.gguf", tiny_llama_dir,
                                                                   "llama", Q.Q4_0))
    assert model_fingerprint(other) == model_fingerprint(path)  # same header: same model shape and vocabulary


def test_tokenizer_from_the_vocabulary_matches_tokenizer_json(tmp_path, tiny_llama_dir):
    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir, "llama", Q.Q8_0)
    ours, ref = build_tokenizer(GGUFModel(path)), Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    assert ours.get_vocab_size() == ref.get_vocab_size() == load_model_config(path).vocab_size
    for text in ["the quick brown fox", "  two spaces, then\ttab\nnewline", "digits 12345 end<|endoftext|>",
                 "ünïcödé and 日本"]:
        assert ours.encode(text).ids == ref.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def _bad(tmp_path, tiny_llama_dir, edit) -> str:
    path = write_gguf(tmp_path / "bad.gguf", tiny_llama_dir, "llama", Q.Q8_0, edit=edit)
    with pytest.raises(GGUFError) as e:
        load_model_config(path)
    return str(e.value)


def test_bad_files_fail_at_open_naming_what_is_wrong(tmp_path, tiny_llama_dir):
    def arch(meta, tensors):
        meta["general.architecture"] = "gpt2"

    def heads(meta, tensors):
        meta["llama.attention.head_count"] = 8
        meta["llama.rope.dimension_count"] = 32

    def qtype(meta, tensors):
        w, _ = tensors["blk.1.ffn_up.weight"]
        tensors["blk.1.ffn_up.weight"] = (w, Q.Q2_K)

    def missing(meta, tensors):
        del tensors["blk.1.ffn_down.weight"]

    assert "architecture 'gpt2' is not supported" in _bad(tmp_path, tiny_llama_dir, arch)
    assert "blk.0.attn_k.weight has shape (128, 256), but the metadata implies (64, 256)" in _bad(
        tmp_path, tiny_llama_dir, heads)
    assert "blk.1.ffn_up.weight is stored as Q2_K" in _bad(tmp_path, tiny_llama_dir, qtype)
    assert "1 tensors missing" in _bad(tmp_path, tiny_llama_dir, missing)


def test_a_truncated_file_fails_naming_the_tensor(tmp_path, tiny_llama_dir, capsys):
    from scheduler_svc.entrypoints.service_config import (
        load_config,  # (the scheduler extra: not on a GPU box)
    )

    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir, "llama", Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(GGUFError, match="truncated: tensor .* ends at byte"):
        load_model(path)
    path.write_bytes(data[:4000])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFModel(path)
    with pytest.raises(SystemExit):  # the scheduler refuses it at start too
        load_config(["--model", str(path)])
    assert "truncated" in capsys.readouterr().err
    path.write_bytes(b"NOPE" + data[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFModel(path)


def test_both_services_take_the_file_or_a_directory_holding_only_it(tmp_path, tiny_llama_dir):
    """A volume mounted at a fixed path (the Kubernetes manifests' /models/model) may hold one .gguf."""
    from scheduler_svc.entrypoints.service_config import (
        load_config,  # (the scheduler extra: not on a GPU box)
    )

    volume = tmp_path / "model"
    volume.mkdir()
    path = write_gguf(volume / "m.gguf", tiny_llama_dir, "llama", Q.Q8_0)
    for given in (path, volume):
        assert resolve_model(given) == path
        assert load_config(["--model", str(given)]).model_dir == path
        assert parse_config(["--model", str(given), "--scheduler", "tcp://127.0.0.1:5556"]).model_dir == path
    write_gguf(volume / "other.gguf", tiny_llama_dir, "llama", Q.Q8_0)
    assert resolve_model(volume) == volume  # two files: which one is not guessed
    with pytest.raises(SystemExit):
        load_config(["--model", str(volume)])
    assert resolve_model(tiny_llama_dir) == tiny_llama_dir


CORPUS = ["the quick brown fox jumps over the lazy dog", "paged attention keeps the cache in blocks",
          "a block table maps logical blocks to physical ones", "copy on write shares the prompt's blocks",
          "the scheduler plans one step while the executor runs the last"] * 20


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_and_transformers(tmp_path):
    """Llama 2 and Mistral files carry a SentencePiece BPE (scores, no merges; BOS added)."""
    vocab = sentencepiece_vocab(CORPUS)
    sp = vocab["_processor"]
    path = write_gguf(tmp_path / "spm.gguf", None, "llama", Q.Q8_0, vocab=vocab)
    ours = build_tokenizer(GGUFModel(path))
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["the lazy fox plans blocks", " leading space", "Unseen WORDS, digits 42 and 日本!"]:
        ids = ours.encode(text).ids
        assert ids == [sp.bos_id(), *sp.encode(text)], text
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == sp.decode(sp.encode(text))


def test_llama3_rope_frequency_factors_become_its_rope_scaling(tmp_path, tiny_llama_dir):
    """Llama 3.1+ files store RoPE's per-frequency factors; the parameters that give them back are
    taken, and factors that match no such parameters are refused."""
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    factors = np.array(llama3_factors(500000.0, 64, params), dtype=np.float32)

    def llama3(meta, tensors, freqs=factors):
        meta["llama.rope.freq_base"] = 500000.0
        tensors["rope_freqs.weight"] = (freqs, Q.F32)

    path = write_gguf(tmp_path / "l3.gguf", tiny_llama_dir, "llama", Q.Q8_0, edit=llama3)
    rope = load_model_config(path).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    odd = write_gguf(tmp_path / "odd.gguf", tiny_llama_dir, "llama", Q.Q8_0,
                     edit=lambda m, t: llama3(m, t, factors[::-1].copy()))
    with pytest.raises(GGUFError, match="rope_freqs does not match Llama 3's RoPE scaling"):
        GGUFModel(odd)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None),
                    reason="needs a CUDA GPU and CuPy (run make gpu-check)")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_on_cuda_a_gguf_file_generates_as_on_the_cpu(tmp_path, tiny_llama_dir, qtype):
    """The GPU path dequantizes at load too (no kernel computes on the blocks yet): float32 on cuda
    with the CUDA kernels gives the CPU path's greedy tokens, which are transformers'."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from executor_svc.kv_cache import KVCache
    from executor_svc.runner import ModelRunner
    from executor_svc.sampler import Sampler

    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir, "llama", qtype)
    vocab = load_model_config(path).vocab_size
    prompts = {0: _prompt(23, 1, vocab), 1: _prompt(5, 2, vocab), 2: _prompt(40, 3, vocab)}
    model = load_model(path, "cuda", torch.float32)
    drv = PlanDriver(ModelRunner(model, KVCache(model.cfg, 16, 64, 0, torch.float32, "cuda"),
                                 CupyAttentionBackend(), Sampler(seed=0)))
    for sid, p in prompts.items():
        drv.add(sid, p)
    drv.run_until(16, chunk=9)
    assert {sid: drv.seqs[sid].outputs[:16] for sid in prompts} == _ours(path, prompts, 16)
