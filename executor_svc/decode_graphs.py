"""CUDA graphs for pure decode steps: one replay instead of a few hundred kernel launches.

A decode step's forward is the same kernels every time; what changes is a few integers per
sequence. On a GPU the host cost of launching those kernels one by one (Python, argument checks,
launch latency) is several times the device's work, so the step is captured once per batch-size
bucket into a CUDA graph and replayed:

* **Buckets** (``--cuda-graph-sizes``, vLLM's sizes by default: 1, 2, 4, 8, then every multiple of
  8 up to 256): a step of ``n`` sequences replays the smallest bucket ``>= n``; its ``size - n``
  padding rows compute garbage that is never read (slot -1: they write no KV; context 1 in block
  0: they read a valid slot). A step above the largest bucket, a prefill or mixed step, or one
  that scores prompt tokens runs eagerly.
* **Static inputs** (:class:`StaticInputs`): token ids, positions, slots, context lengths,
  query offsets and block tables live in one device buffer that every graph reads; a step
  writes them into a pinned host mirror and moves them with one host-to-device copy.
* **A graph-safe plan**: the graph's attention metadata fixes ``max_seq_len`` at the longest
  context the block tables can hold, so the decode kernel's split (its grid) is fixed per bucket
  and never depends on the step; a sequence shorter than that skips the partitions it lacks.
* **Capture at start, never during a step** (:meth:`DecodeGraphs.capture_all`): every bucket is
  warmed up and captured, largest first in one memory pool, with padding rows only, before the
  executor registers, so capturing writes no KV block a sequence owns.
* **One logits buffer** ``[largest bucket, vocab]`` float32, outside the pool, that every graph's
  LM head writes into: what a graph returns is the one tensor that outlives its capture, so with
  an output of its own each of the 35 default buckets would keep ``size x vocab x 4`` bytes
  (2.2 GB at a 128K vocabulary) that the KV budget, sized before capture, did not leave. Only
  one step's logits are live at a time: they are consumed (sampled, or their argmax enqueued)
  before the next replay is launched.

Without a GPU (tests), the same object runs the same buffers, padding and metadata eagerly
(``capture=False``): the CPU twin of everything but the capture itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.batch import Batch
from executor_svc.graph_buckets import DEFAULT_SIZES, bucket_for
from executor_svc.kv_cache import KVCache
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.token_chain import Chain


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the buffer

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class StaticInputs:
    """The decode inputs of every graph: one device buffer, typed views into it, a host mirror.

    Fields are laid out with the block tables last, so a bucket of ``size`` rows needs the
    buffer's prefix up to table row ``size``: one copy moves exactly what the step uses. Two host
    mirrors take turns: a step prepared ahead may be launched before the step before it has run
    (``token_chain.py``), and the mirror it writes is the one whose copy the step two back made,
    which has run by then (waited for on its event, should it not have).

    ``chain_src``: a row whose input token is one the step before samples on the device holds that
    token's row in it (-1: the token is in ``input_ids``).
    """

    def __init__(self, max_seqs: int, width: int, device: torch.device) -> None:
        spec = [("input_ids", np.int64, (max_seqs,)), ("positions", np.int64, (max_seqs,)),
                ("slot_mapping", np.int64, (max_seqs,)), ("chain_src", np.int64, (max_seqs,)),
                ("seq_lens", np.int32, (max_seqs,)),
                ("query_start_loc", np.int32, (max_seqs + 1,)), ("block_tables", np.int32, (max_seqs, width))]
        self.fields: dict[str, _Field] = {}
        offset = 0
        for name, dtype, shape in spec:
            f = _Field(name, np.dtype(dtype), shape, offset)
            self.fields[name] = f
            offset += -(-f.nbytes // 16) * 16  # every view 16-byte aligned (the kernels' vector loads)
        self.width = width
        self.gpu = device.type == "cuda"
        self.hosts = [torch.zeros(offset, dtype=torch.uint8, pin_memory=self.gpu) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each mirror's last copy (GPU)
        self.turn = 0
        self.device_buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
        self.mirrors = [{n: raw[f.offset:f.offset + f.nbytes].view(f.dtype).reshape(f.shape)
                         for n, f in self.fields.items()} for raw in (h.numpy() for h in self.hosts)]
        self.d = {n: self.device_buffer[f.offset:f.offset + f.nbytes].view(_TORCH[f.dtype]).view(f.shape)
                  for n, f in self.fields.items()}
        for h in self.mirrors:
            h["query_start_loc"][:] = np.arange(max_seqs + 1)  # one token per row, every step
        self.copies = 0  # host-to-device copies made (tests: one per step)

    @property
    def h(self) -> dict[str, np.ndarray]:
        """The host mirror the last fill wrote."""
        return self.mirrors[self.turn]

    def fill(self, batch: Batch | None, size: int, chain: Chain | None = None) -> None:
        """Write a decode batch's rows, then padding up to ``size``, and copy them to the device.
        ``batch`` None: padding only (capture). ``chain``: the rows whose token the step before
        samples on the device, written into ``input_ids`` there after the copy."""
        self.turn ^= 1
        if (event := self.copied[self.turn]) is not None:
            event.synchronize()  # (the step two back: done in practice)
        h, n = self.mirrors[self.turn], 0 if batch is None else batch.meta.num_seqs
        if batch is not None:
            tables = batch.host_tables
            h["input_ids"][:n] = batch.token_ids
            h["positions"][:n] = batch.host_positions
            h["slot_mapping"][:n] = batch.host_slots
            h["seq_lens"][:n] = batch.meta.seq_lens_host
            h["block_tables"][:n, :tables.shape[1]] = tables
            h["block_tables"][:n, tables.shape[1]:] = 0
        h["input_ids"][n:size] = 0
        h["positions"][n:size] = 0
        h["slot_mapping"][n:size] = -1  # padding writes no KV
        h["seq_lens"][n:size] = 1  # and reads slot 0 of block 0, which always exists
        h["block_tables"][n:size] = 0
        h["chain_src"][:size] = -1
        if chain is not None:
            h["chain_src"][chain.rows] = chain.src
        tables = self.fields["block_tables"]
        end = tables.offset + size * self.width * tables.dtype.itemsize
        self.device_buffer[:end].copy_(self.hosts[self.turn][:end], non_blocking=True)
        if self.gpu:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()
        self.copies += 1
        if chain is not None and chain.rows:
            ids, src = self.d["input_ids"][:size], self.d["chain_src"][:size]
            ids.copy_(torch.where(src >= 0, chain.tokens.index_select(0, src.clamp(min=0)), ids))

    def meta(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """The metadata of a bucket: views of the first ``size`` rows. ``max_seq_len`` is fixed (the
        table width's capacity), so the attention kernels' grids are the same at every replay."""
        d = self.d
        host_mirrors = self.device_buffer.device.type != "cuda"  # a graph must not depend on host lists
        return AttentionMetadata(
            slot_mapping=d["slot_mapping"][:size], query_start_loc=d["query_start_loc"][:size + 1],
            seq_lens=d["seq_lens"][:size], block_tables=d["block_tables"][:size], max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_host=list(range(size + 1)) if host_mirrors else None,
            seq_lens_host=self.h["seq_lens"][:size].tolist() if host_mirrors else None)


class DecodeGraphs:
    """Replays a captured forward (and LM head) for pure decode steps, by bucket."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend, max_model_len: int,
                 sizes: tuple[int, ...] = DEFAULT_SIZES, *, capture: bool | None = None) -> None:
        self.model, self.kv, self.backend = model, kv, backend
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.sizes = tuple(sorted(set(sizes)))
        self.width = math.ceil(max_model_len / kv.block_size)
        self.max_seq_len = self.width * kv.block_size
        self.inputs = StaticInputs(self.sizes[-1], self.width, model.device)
        self.logits = torch.empty(self.sizes[-1], model.cfg.vocab_size, dtype=torch.float32, device=model.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = None
        self.replays = 0  # steps served from a bucket
        self.padded_rows = 0  # padding rows computed and discarded

    def serves(self, batch: Batch) -> bool:
        """A pure decode step whose every row samples, within the largest bucket and the tables."""
        meta = batch.meta
        n = meta.num_seqs
        return (meta.max_query_len == 1 and len(batch.token_ids) == n and n <= self.sizes[-1]
                and not batch.prompt_rows and len(batch.logits_rows) == n
                and meta.max_seq_len <= self.max_seq_len and batch.host_tables.shape[1] <= self.width)

    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first (they share one memory pool). Runs at
        start, before any sequence exists: padding rows write no KV."""
        if self._graphs:
            raise RuntimeError("decode graphs: already captured (capturing again would run mid-serving)")
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._graphs[size] = self._record(size)

    def run(self, batch: Batch, chain: Chain | None = None) -> torch.Tensor:
        """The step's logits ``[n, vocab]`` float32 (views of the graph's output until the next step);
        ``chain``: input tokens the step before samples on the device (``token_chain.py``)."""
        n = batch.meta.num_seqs
        size = bucket_for(n, self.sizes)
        if size is None or size not in self._graphs:
            raise RuntimeError(f"decode graphs: no captured bucket for {n} sequences (capture_all() runs at start)")
        self.inputs.fill(batch, size, chain)
        graph, out = self._graphs[size]
        if graph is None:
            out = self._forward(size)  # the CPU twin: the same buffers, padding and metadata, eagerly
        else:
            graph.replay()
        self.replays += 1
        self.padded_rows += size - n
        return out[:n]

    def _forward(self, size: int) -> torch.Tensor:
        d = self.inputs.d
        meta = self.inputs.meta(size, self.max_seq_len)
        hidden, logits = self.model.forward_with_logits(d["input_ids"][:size], d["positions"][:size],
                                                        self.kv.layers, meta, self.backend)
        out = self.logits[:size]
        return out.copy_(logits) if logits is not None else self.model.compute_logits(hidden, out=out)

    def _record(self, size: int) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]:
        self.inputs.fill(None, size)
        if not self.capture:
            self._forward(size)  # what capture's warm-up would run: padding only, no KV written
            return None, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: kernels compiled, allocator sized
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(size)
        self._pool = graph.pool()
        return graph, out
