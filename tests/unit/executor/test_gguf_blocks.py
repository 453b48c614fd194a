"""A GGUF file's Q8_0/Q4_0/Q4_1/Q4_K layers stay in their blocks on the CPU (``--quantization gguf``,
the default for a GGUF ``--model`` with ``--dtype auto``): the same weights as the dequantized
model, the file's bytes in memory, logits as float32's; other types are dequantized at load."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from executor_svc.config import parse_config
from executor_svc.model import load_model
from executor_svc.model.block_weights import BlockEmbedding, BlockLinear
from executor_svc.model.weights import PackedLinear
from pagedserve.gguf_model import GGUFModel
from testing.cpu_agreement import Forcer
from testing.gguf_files import SIZES as K_SIZES
from testing.gguf_files import write_gguf

SIZES = dict(hidden=64, intermediate=160)
PACKED_PER_STORED = {Q.Q4_K: Fraction(2368, 2304)}  # (its 6-bit fields spread to a byte each)


def _linears(model) -> dict[str, PackedLinear]:
    out = {"embed_tokens": model.embed_tokens}
    if model.lm_head is not None:
        out["lm_head"] = model.lm_head
    for i, layer in enumerate(model.layers):
        out |= {f"{i}.qkv": layer.self_attn.qkv_proj, f"{i}.o": layer.self_attn.o_proj,
                f"{i}.gate_up": layer.mlp.gate_up_proj, f"{i}.down": layer.mlp.down_proj}
    return out


def _logits(model, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Teacher-forced: each prompt, then its own tokens shifted (the same inputs in every model)."""
    f = Forcer(model, torch.float32, len(prompts), 64)
    rows = [torch.stack([f.step([i], [p])[0] for i, p in enumerate(prompts)])]
    for k in range(steps):
        rows.append(f.step(list(range(len(prompts))), [[p[k]] for p in prompts]))
    return torch.stack(rows, 1)


@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q8_0), ("llama", Q.Q4_0), ("llama", Q.Q4_1), ("qwen2", Q.Q4_1),
                                        ("llama", Q.Q4_K), ("qwen2", Q.Q4_K)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quantized_layers_keep_the_files_blocks_and_compute_as_float32(tmp_path, tiny_llama_dir, arch, qtype):
    sizes = K_SIZES if qtype == Q.Q4_K else SIZES
    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir, arch, qtype, tied=arch == "qwen2", sizes=sizes)
    ours, f32 = load_model(path, quantization="gguf"), load_model(path)
    fmt = qtype.name.lower()
    blocks, floats = _linears(ours), _linears(f32)
    for name, layer in blocks.items():
        assert isinstance(layer, BlockLinear) and layer.fmt == fmt and layer.weight.dtype == torch.uint8, name
        # the same weights as the dequantized model (q/k rows unpermuted, q/k/v and gate/up fused)
        assert torch.equal(layer.unpacked(), floats[name].unpacked()), name
    assert isinstance(ours.embed_tokens, BlockEmbedding) and (ours.lm_head is None) == (arch == "qwen2")
    # the decoder's bytes are the file's (its rows are whole 64-row units): nothing dequantized
    gguf = GGUFModel(path)
    stored = sum(t.nbytes for n, t in gguf.file.tensors.items() if n.startswith("blk.") and t.ggml_type == qtype)
    held = sum(m.weight.numel() for n, m in blocks.items() if n[0].isdigit())
    assert held == stored * PACKED_PER_STORED.get(qtype, 1)
    vocab = ours.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (9, 17, 30)]
    a, b = _logits(ours, prompts, 6), _logits(f32, prompts, 6)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * float(b.abs().max()))


def test_a_layer_whose_parts_differ_in_type_is_dequantized(tmp_path, tiny_llama_dir):
    """q/k/v are one fused layer: a file with v in Q8_0 beside Q4_0 q and k (as llama.cpp's
    mixed files do) dequantizes that layer, and keeps the others' blocks."""

    def v_in_q8(meta, tensors):
        for name, (w, _) in list(tensors.items()):
            if ".attn_v." in name:
                tensors[name] = (w, Q.Q8_0)

    path = write_gguf(tmp_path / "mixed.gguf", tiny_llama_dir, "llama", Q.Q4_0, sizes=SIZES, edit=v_in_q8)
    model = load_model(path, quantization="gguf")
    layer = model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, BlockLinear) and layer.self_attn.qkv_proj.fmt == "float32"
    assert isinstance(layer.self_attn.o_proj, BlockLinear) and layer.self_attn.o_proj.fmt == "q4_0"
    assert model.weight_format == "float32+q4_0"


def test_gguf_blocks_are_the_cpu_default_and_an_explicit_dtype_dequantizes(tmp_path, tiny_llama_dir):
    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir, "llama", Q.Q4_1, sizes=SIZES)
    base = ["--model", str(path), "--scheduler", "tcp://127.0.0.1:5556"]
    assert parse_config(base, {}).quantization == "gguf"
    assert parse_config([*base, "--dtype", "float32"], {}).quantization is None
    assert parse_config([*base, "--dtype", "bfloat16"], {}).quantization is None
    assert parse_config([*base, "--quantization", "int8"], {}).quantization == "int8"
    assert parse_config([*base, "--device", "cuda"], {}).quantization is None  # (the GPU dequantizes)
    with pytest.raises(SystemExit):
        parse_config(["--model", str(tiny_llama_dir), "--scheduler", "tcp://127.0.0.1:5556", "--quantization",
                      "gguf"], {})
    with pytest.raises(ValueError, match="keeps a GGUF file's blocks"):
        load_model(tiny_llama_dir, quantization="gguf")
    # without the C kernels the blocks would run on torch, dequantized at every call: dequantized at load
    model = load_model(path, quantization="gguf", cpu_kernels=False)
    assert model.layers[0].mlp.down_proj.fmt == "float32"


def test_int8_is_q8_0_blocks_of_the_float_weights(tiny_llama_dir):
    """--quantization int8 rounds each float weight row in blocks of 32 as llama.cpp's Q8_0 does."""
    from gguf.quants import dequantize, quantize

    ours, f32 = load_model(tiny_llama_dir, quantization="int8"), load_model(tiny_llama_dir)
    for name, layer in _linears(ours).items():
        assert isinstance(layer, BlockLinear) and layer.fmt == "q8_0", name
        w = _linears(f32)[name].unpacked().numpy()
        want = dequantize(quantize(w, Q.Q8_0), Q.Q8_0).reshape(w.shape)
        assert torch.equal(layer.unpacked(), torch.from_numpy(want)), name
