"""Load an HF checkpoint directory (safetensors, sharded or not) or a GGUF file into our model.

Weights are read tensor by tensor with ``safetensors`` (never pickle) and
copied into parameters allocated once on the target device, so peak memory is
the model plus one tensor. HF's separate q/k/v and gate/up weights are copied
into slices of our fused projections. With ``quantization="gguf"`` a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K
layers keep their blocks instead (``block_weights.py``); their float parameters, allocated but
never written, take no memory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from executor_svc.cpu_ops import load_cpu_ops
from executor_svc.model.architecture import ModelConfig, UnsupportedModelError, load_model_config
from executor_svc.model.block_weights import BlockEmbedding, BlockLinear, block_format
from executor_svc.model.cpu_pack import pack_for_cpu, weight_format
from executor_svc.model.cuda_layers import install as install_fused_layers
from executor_svc.model.gguf_weights import gguf_blocks, gguf_tensors, hf_types
from executor_svc.model.llama import AllReduce, LlamaForCausalLM
from executor_svc.model.rope import RotaryEmbedding
from executor_svc.parallel.shard import NO_SHARD, TPShard
from pagedserve.model_dir import open_gguf
from pagedserve.wire.fingerprint import weight_files

log = logging.getLogger(__name__)

_PROGRESS_MIN_BYTES = 512 * 1024 * 1024  # show a progress bar only for checkpoints this large
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Target(NamedTuple):
    """Where one HF tensor goes: rows ``[start, start + rows)`` of our parameter ``param``, from
    the whole tensor (``src is None``) or from ``src = (dim, first, count)`` of it (a rank's shard)."""

    param: str
    start: int
    rows: int
    src: tuple[int, int, int] | None = None


def _targets(cfg: ModelConfig, shard: TPShard = NO_SHARD) -> dict[str, Target]:
    """HF tensor name -> Target for every tensor this rank needs (all of them when not sharded)."""
    hd = cfg.head_dim
    (q0, nq), (kv0, nkv), (i0, ni) = shard.q_heads(cfg), shard.kv_heads(cfg), shard.intermediate(cfg)
    q, kv, inter = nq * hd, nkv * hd, ni
    cut = shard.size > 1  # read slices only when sharded: a whole tensor loads as before

    def rows(first: int, count: int) -> tuple[int, int, int] | None:
        return (0, first, count) if cut else None

    def cols(first: int, count: int) -> tuple[int, int, int] | None:
        return (1, first, count) if cut else None

    t: dict[str, Target] = {
        "model.embed_tokens.weight": Target("embed_tokens.weight", 0, cfg.vocab_size),
        "model.norm.weight": Target("norm.weight", 0, cfg.hidden_size),
    }
    if shard.holds_lm_head and not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target("lm_head.weight", 0, cfg.vocab_size)
    for i in range(cfg.num_layers):  # (every rank holds every layer, a slice of each)
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        kinds = ["weight"] + (["bias"] if cfg.qkv_bias else [])
        for kind in kinds:
            for proj, start, n, src in (("q_proj", 0, q, rows(q0 * hd, q)), ("k_proj", q, kv, rows(kv0 * hd, kv)),
                                        ("v_proj", q + kv, kv, rows(kv0 * hd, kv))):
                t[f"{hf}self_attn.{proj}.{kind}"] = Target(f"{ours}self_attn.qkv_proj.{kind}", start, n, src)
        t[f"{hf}self_attn.o_proj.weight"] = Target(f"{ours}self_attn.o_proj.weight", 0, cfg.hidden_size,
                                                   cols(q0 * hd, q))
        if cfg.o_bias:
            t[f"{hf}self_attn.o_proj.bias"] = Target(f"{ours}self_attn.o_proj.bias", 0, cfg.hidden_size)
        t[f"{hf}mlp.gate_proj.weight"] = Target(f"{ours}mlp.gate_up_proj.weight", 0, inter, rows(i0, ni))
        t[f"{hf}mlp.up_proj.weight"] = Target(f"{ours}mlp.gate_up_proj.weight", inter, inter, rows(i0, ni))
        t[f"{hf}mlp.down_proj.weight"] = Target(f"{ours}mlp.down_proj.weight", 0, cfg.hidden_size, cols(i0, ni))
        t[f"{hf}input_layernorm.weight"] = Target(f"{ours}input_layernorm.weight", 0, cfg.hidden_size)
        t[f"{hf}post_attention_layernorm.weight"] = Target(f"{ours}post_attention_layernorm.weight", 0,
                                                           cfg.hidden_size)
    return t


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               shard: TPShard = NO_SHARD, reduce: AllReduce | None = None, quantization: str | None = None,
               cpu_kernels: bool = True, fused_layers: bool = True) -> LlamaForCausalLM:
    """The whole model, or with ``shard`` one tensor-parallel rank's part of it (only those bytes
    are read) and ``reduce`` its sum over ranks.

    A float32 or bfloat16 model on the CPU (a whole one or a rank's shard) is packed for the CPU
    kernels (``cpu_pack.py``): weights in ``dtype``, or (unsharded) in Q8_0 blocks with
    ``quantization="int8"``, or with ``quantization="gguf"`` (a GGUF file) the file's
    Q8_0/Q4_0/Q4_1/Q4_K layers as stored and the rest in ``dtype``; activations float32.
    ``cpu_kernels=False`` keeps the formats but computes them with torch alone (a GGUF file is
    then dequantized at load). On CUDA the layers run on the fused kernels unless ``fused_layers`` is
    False (``cuda_layers.install`` decides)."""
    cfg = load_model_config(model_dir)
    packed = torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if quantization is not None and not (packed and shard.size == 1):
        raise UnsupportedModelError(f"quantization {quantization!r}: the CPU executor's, unsharded, with "
                                    f"float32 or bfloat16 (got device {device}, dtype {dtype}, {shard.size} ranks)")
    gguf = Path(model_dir).is_file()  # a GGUF file (config.py has checked it)
    if quantization == "gguf" and not gguf:
        raise UnsupportedModelError(f"quantization 'gguf' keeps a GGUF file's blocks; {model_dir} is a directory")
    fmt = weight_format(dtype, quantization) if packed else None
    ops = load_cpu_ops() if packed and cpu_kernels else None
    # Packed formats convert from the checkpoint's own precision (a bfloat16 checkpoint loads as
    # such, halving the peak; a float32 one keeps exact norms and int8 scales).
    load_dtype = dtype
    if fmt is not None:
        load_dtype = torch.bfloat16 if fmt != "float32" and cfg.torch_dtype == "bfloat16" else torch.float32
    local = shard.local_config(cfg) if shard.size > 1 else cfg
    model = LlamaForCausalLM(local, reduce, with_lm_head=shard.holds_lm_head).to_empty(device=device).to(load_dtype)
    params = dict(model.named_parameters())
    targets = _targets(cfg, shard)
    if gguf:
        kept = quantization == "gguf" and ops is not None  # (without the kernels blocks would be slow)
        seen = _load_gguf(Path(model_dir), targets, params, model if kept else None, ops)
    else:
        seen = _load_safetensors(model_dir, targets, params)
    missing = sorted(set(targets) - seen)
    if missing:
        raise UnsupportedModelError(f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, torch.device(device))
    if fmt is not None:
        pack_for_cpu(model, fmt, ops)
    install_fused_layers(model, fused_layers)
    return model.eval()


def _load_safetensors(model_dir: str | Path, targets: dict[str, Target],
                      params: dict[str, torch.nn.Parameter]) -> set[str]:
    files = weight_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    seen: set[str] = set()
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
              disable=total < _PROGRESS_MIN_BYTES) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    target = targets.get(name)
                    if target is None:  # not read at all (a tied or other rank's LM head, ...)
                        if not name.endswith(_IGNORED_SUFFIXES) and name != "lm_head.weight":
                            log.warning("ignoring unexpected weight %s", name)
                        continue
                    tensor = _read(f, name, target)
                    bar.update(tensor.numel() * tensor.element_size())
                    _copy_into(params, target, name, tensor)
                    seen.add(name)
    return seen


def _load_gguf(path: Path, targets: dict[str, Target], params: dict[str, torch.nn.Parameter],
               model: LlamaForCausalLM | None = None, ops=None) -> set[str]:
    """Each needed tensor dequantized (gguf_weights.py), cut to this rank's slice, copied in; with
    ``model``, the layers whose tensors are all in one block format keep their blocks instead."""
    gguf = open_gguf(path)
    kept = _kept_in_blocks(gguf, targets) if model is not None else set()
    seen: set[str] = set()
    with tqdm(total=len(targets), desc="dequantizing GGUF tensors", disable=path.stat().st_size < _PROGRESS_MIN_BYTES) \
            as bar:
        for name, tensor in gguf_tensors(gguf, set(targets) - kept):
            target = targets[name]
            if target.src is not None:
                dim, first, count = target.src
                tensor = tensor.narrow(dim, first, count)
            _copy_into(params, target, name, tensor)
            seen.add(name)
            bar.update()
    if kept:  # (after the float tensors: a layer's bias is one)
        seen |= _install_blocks(model, gguf, targets, kept, ops)
    return seen


def _kept_in_blocks(gguf, targets: dict[str, Target]) -> set[str]:
    """HF names of the tensors whose layer keeps its blocks: every part of it (q, k and v of the
    fused q/k/v, ...) stored in one block format the kernels compute on."""
    types, parts = hf_types(gguf), {}
    for name, target in targets.items():
        parts.setdefault(target.param, []).append(name)
    kept = set()
    for param, names in parts.items():
        formats = {block_format(types[n]) for n in names}
        if param.endswith("_proj.weight") or param in ("embed_tokens.weight", "lm_head.weight"):
            if len(formats) == 1 and None not in formats:
                kept.update(names)
    return kept


def _install_blocks(model: LlamaForCausalLM, gguf, targets: dict[str, Target], kept: set[str], ops) -> set[str]:
    """Replace each kept layer of ``model`` by a BlockLinear (BlockEmbedding) on its stored rows."""
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    fmts: dict[str, str] = {}
    for name, rows, qtype in gguf_blocks(gguf, kept):
        target = targets[name]
        parts.setdefault(target.param, []).append((target.start, rows))
        fmts[target.param] = block_format(qtype)
    for param, pieces in parts.items():
        module_name = param.removesuffix(".weight")
        old = model.get_submodule(module_name)
        raw = np.concatenate([rows for _, rows in sorted(pieces, key=lambda p: p[0])])
        cls = BlockEmbedding if module_name == "embed_tokens" else BlockLinear
        bias = getattr(old, "bias", None)
        new = cls(raw, fmts[param], old.weight.shape[1], None if bias is None else bias.data, ops)
        parent, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return kept


def _read(f, name: str, target: Target) -> torch.Tensor:
    """The whole tensor, or only this rank's slice of it (only those bytes are read)."""
    if target.src is None:
        return f.get_tensor(name)
    dim, first, count = target.src
    sl = f.get_slice(name)
    shape = sl.get_shape()
    if dim >= len(shape) or first + count > shape[dim]:
        raise UnsupportedModelError(f"weight {name}: shape {tuple(shape)} too small for rows/columns "
                                    f"[{first}, {first + count}) of dim {dim} (does config.json match?)")
    return sl[first:first + count] if dim == 0 else sl[:, first:first + count]


def _copy_into(params: dict[str, torch.nn.Parameter], target: Target, name: str, tensor: torch.Tensor) -> None:
    param_name, start, rows, _ = target
    dst = params[param_name].data[start:start + rows]
    if tuple(tensor.shape) != tuple(dst.shape):
        raise UnsupportedModelError(
            f"weight {name}: shape {tuple(tensor.shape)} does not match config.json's {tuple(dst.shape)}")
    dst.copy_(tensor)
