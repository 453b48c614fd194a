"""The CPU fast path of a decode step: the whole decoder stack in one C call.

``LlamaForCausalLM.forward_with_logits`` hands a step to :class:`DecodeStack` when every
sequence adds exactly one token (pure decode), or when every row's logits are wanted (a speculative
verification: a sequence's new tokens become rows of their own, each a decode query over the
sequence's table cut at its position), the model was packed for the CPU (``cpu_pack.py``)
and the attention backend is one whose kernel the stack runs (``runs_decode_stack``: the fused CPU
backend). The C side (``csrc/decode_stack_cpu.c``) runs norms,
projections, rotary, the KV write, paged attention and the MLP of every layer in one OpenMP
region: no per-operator dispatch from Python, which at batch 1 would cost as much as reading
the weights. The same call computes the LM head of every row and returns those logits with the hidden
states (the runner takes them when every row samples, as in a pure decode step). Any
other step (prefill, chunked prefill, mixed) runs the torch modules, whose linear layers call
the same kernels.
"""

from __future__ import annotations

import ctypes
import time

import torch

from executor_svc.attention import AttentionMetadata, KVCaches
from executor_svc.attention_cpu import per_row_tables
from executor_svc.cpu_kernels import KV_TYPES
from executor_svc.cpu_ops import CpuOps, LayerDesc, ModelDesc, check_status
from executor_svc.step_threads import StepThreads


class DecodeStack:
    def __init__(self, model, ops: CpuOps) -> None:
        self.model, self.ops = model, ops
        self._bound: tuple | None = None  # (key, caches, ModelDesc, LayerDesc array)
        self._work = torch.empty(0, dtype=torch.uint8)
        # All compute threads, or one fewer when timed faster: off until the executor turns it on
        # (--cpu-decode-threads adaptive), so in-process benchmarks and tests time a fixed count.
        self.threads = StepThreads(enabled=False)
        self._last: tuple[int, int, int, float, float] | None = None  # (rows, most, threads, start, call s)

    def _bind(self, caches: KVCaches) -> ModelDesc:
        """The C model descriptor for these KV caches (built once per cache set)."""
        lora = getattr(self.model, "lora", None)
        key = (id(caches), len(caches), caches[0][0].data_ptr(), caches[-1][1].data_ptr(), id(lora))
        if self._bound is not None and self._bound[0] == key:
            return self._bound[2]
        m, cfg = self.model, self.model.cfg
        if len(caches) != cfg.num_layers:
            raise ValueError(f"decode stack: {len(caches)} KV cache layers for {cfg.num_layers} model layers")
        shape, dtype = caches[0][0].shape, caches[0][0].dtype
        for k, v in caches:
            if k.shape != shape or v.shape != shape or k.dtype != dtype or v.dtype != dtype:
                raise ValueError("decode stack: every layer's K and V caches must share one shape and dtype")
            if not (k.is_contiguous() and v.is_contiguous()) or k.device.type != "cpu":
                raise ValueError("decode stack: KV caches must be contiguous CPU tensors")
        if dtype not in KV_TYPES or shape[2:] != (cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"decode stack: KV cache {tuple(shape)} {dtype} does not fit {cfg.num_kv_heads} KV heads "
                             f"of {cfg.head_dim} (float32 or bfloat16)")
        layers = (LayerDesc * cfg.num_layers)()
        for desc, layer, (k, v) in zip(layers, m.layers, caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            desc.qkv, desc.o = attn.qkv_proj.desc(), attn.o_proj.desc()
            desc.gate_up, desc.down = mlp.gate_up_proj.desc(), mlp.down_proj.desc()
            desc.ln1, desc.ln2 = layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()
            desc.k_cache, desc.v_cache = k.data_ptr(), v.data_ptr()
        if lora is not None and lora.slots is not None:  # (LoRA: the slots' tensors, fixed for the model's life)
            for desc, projections in zip(layers, lora.slots.layers, strict=True):
                desc.lora_qkv, desc.lora_o = projections["qkv_proj"].desc(), projections["o_proj"].desc()
                desc.lora_gate_up, desc.lora_down = projections["gate_up_proj"].desc(), projections["down_proj"].desc()
        model = ModelDesc(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.intermediate_size, shape[1], KV_TYPES[dtype], shape[0], cfg.rms_norm_eps,
                          m.layers[0].self_attn.scale, ctypes.cast(layers, ctypes.POINTER(LayerDesc)),
                          m.rotary.inv_freq.data_ptr(), m.norm.weight.data_ptr())
        head = m.logits_head()
        if head is not None and head.ops is not None:
            model.lm_head = head.desc()
        self._bound = (key, caches, model, layers)  # caches kept: its id cannot be reused while bound
        return model

    def _time_last_step(self, now: float) -> None:
        """The step before this one took from its start to now; a period longer than thrice its
        call had something else in it (a prefill, no work) and times nothing."""
        if self._last is not None:
            n, most, used, start, call = self._last
            period = now - start
            self.threads.record(n, most, used, period if period <= 3 * call else None)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, caches: KVCaches,
                 meta: AttentionMetadata, lora=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [n, hidden] float32 embeddings (overwritten) -> (final-normed hidden states [n, hidden],
        every row's logits [n, vocab] float32, None when the model has no packed LM head). ``lora``:
        the step's LoRA batch (executor_svc/lora/apply.py), each token's delta added after each
        projection; None: none."""
        desc = self._bind(caches)
        n = x.shape[0]
        bt, lens, slots = meta.block_tables, meta.seq_lens, meta.slot_mapping
        store_first = meta.max_query_len > 1  # rows of one sequence read each other's K/V (a verification)
        if store_first:
            starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
            bt, lens = per_row_tables(bt.to(torch.int32), starts, meta.seq_lens_host or meta.seq_lens.tolist())
        if not (x.dtype == torch.float32 and x.is_contiguous() and positions.dtype == slots.dtype == torch.int64
                and positions.is_contiguous() and slots.is_contiguous() and positions.shape == slots.shape == (n,)
                and bt.dtype == lens.dtype == torch.int32 and bt.dim() == 2 and bt.stride(1) == 1
                and lens.is_contiguous() and bt.shape[0] == lens.shape[0] == n):
            raise ValueError(f"decode stack: expected {n} decode rows with int64 positions/slots, int32 block "
                             f"tables/seq_lens (one row each) and contiguous float32 embeddings")
        most, start = torch.get_num_threads(), time.perf_counter()
        self._time_last_step(start)
        threads = self.threads.pick(n, most)
        lib = self.ops.lib
        nbytes = lib.ps_stack_work_bytes(ctypes.byref(desc), n, threads)
        if self._work.numel() < nbytes:
            self._work = torch.empty(max(nbytes, 2 * self._work.numel()), dtype=torch.uint8)
        logits = torch.empty(n, desc.lm_head.m, dtype=torch.float32) if desc.lm_head.w else None
        token_lora = order = None
        if lora is not None:  # (kept alive through the call: the descriptor points into them)
            if lora.token_slots.shape != (n,):
                raise ValueError(f"decode stack: {lora.token_slots.shape} LoRA slots for {n} rows")
            token_lora = lora.token_slots.to(torch.int32).contiguous()
            order = torch.argsort(lora.token_slots, stable=True).to(torch.int32)
        desc.token_lora = None if token_lora is None else token_lora.data_ptr()
        desc.lora_order = None if order is None else order.data_ptr()
        call = time.perf_counter()
        check_status("decode stack", lib.ps_decode_stack(
            ctypes.byref(desc), x.data_ptr(), n, positions.data_ptr(), slots.data_ptr(), bt.data_ptr(), bt.stride(0),
            bt.shape[1], lens.data_ptr(), None if logits is None else logits.data_ptr(), self._work.data_ptr(),
            self._work.numel(), threads, int(store_first)))
        self._last = (n, most, threads, start, time.perf_counter() - call)
        return x, logits
