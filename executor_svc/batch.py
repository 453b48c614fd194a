"""A step's batch: the scheduled sequences' new tokens packed back to back, with their layout.

:func:`build_batch` turns the scheduled sequences (their computed counts, new tokens and block
tables) into the forward's inputs: token ids, positions, and the attention metadata every layer
shares (slots, query offsets, context lengths, padded block tables; docs/ARCHITECTURE.md,
"Attention backend interface"). Kept apart from the runner: it is the one place that knows the
packed layout, and tests check it against a per-sequence reference.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from executor_svc.attention import AttentionMetadata
from pagedserve.wire import SamplingParams

if TYPE_CHECKING:
    from executor_svc.grammar import SeqGrammar


@dataclass(slots=True)
class SeqState:
    seq_id: int
    token_ids: list[int]  # prompt, then every output so far (sampled here or appended by the plan)
    num_prompt_tokens: int
    # Logical block i -> physical block id, as int32 (a list is converted): a step gathers every
    # scheduled sequence's table with one C-level extend each (a list of Python ints cost a 64 x
    # 2048-token decode step 0.2 ms in the conversion alone).
    block_ids: array
    num_computed_tokens: int  # tokens whose K/V are in the cache
    sampling: SamplingParams
    grammar: SeqGrammar | None = None  # structured outputs: its matcher (executor_svc/grammar.py)
    # Prompt log-probs (SamplingParams.prompt_logprobs): the next prompt token to score (token t by the
    # logits of position t - 1), -1 when none is owed; what was scored so far, reported with the first sample.
    prompt_lp_next: int = -1
    prompt_lps: list | None = None
    proposals: list[int] | None = None  # speculative decoding: this step's proposed tokens (runner.py)
    # A draft model's proposals (executor_svc/speculative/draft.py): whether this step's are the draft's
    # to make, their distributions (sampled rows: [vocab] float32 each; None for greedy rows), and how
    # many of its tokens have their K/V in the draft's pools.
    drafted: bool = False
    draft_q: list | None = None
    draft_computed: int = 0
    lora_slot: int = -1  # the LoRA slot whose adapter it runs under (-1: the base model)

    def __post_init__(self) -> None:
        if not isinstance(self.block_ids, array) or self.block_ids.typecode != "i":
            self.block_ids = array("i", self.block_ids)


@dataclass(slots=True)
class Batch:
    """One forward's inputs: the layout on the device, the token ids still on the host."""

    token_ids: list[int]  # [num_tokens]; copied to the device when the forward starts
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: list[int]  # rows of the packed tokens whose logits are sampled
    sample_seqs: list[SeqState]  # the sequence of each logits row (kept: a later plan may free it first)
    # Inputs that are tokens the step in flight samples (a plan prepared ahead): (row in
    # token_ids, sequence, index of the token in its token_ids once appended).
    in_flight_inputs: list[tuple[int, SeqState, int]] = field(default_factory=list)
    # Prompt tokens scored by this step (prompt log-probs): (sequence, first token index, its row in
    # token_ids, count); row r's logits score token first + (r - row).
    prompt_rows: list[tuple[SeqState, int, int, int]] = field(default_factory=list)
    prompt_scores: list = field(default_factory=list)  # their wire.PromptLogprobs, once the forward ran
    # Host copies of the layout (positions, slots [num_tokens] int64; block tables [num_seqs, width]
    # int32): what a CUDA-graph replay writes into its static inputs (executor_svc/decode_graphs.py).
    host_positions: np.ndarray | None = None
    host_slots: np.ndarray | None = None
    host_tables: np.ndarray | None = None
    # Speculating sequences (BatchPlan.proposals): (sequence, its proposals, the row of its last
    # committed token), and once the forward ran, the logits of those rows and the proposals but
    # the last ([len(proposals), vocab] each; the last proposal's row is its sampling row).
    spec: list[tuple[SeqState, list[int], int]] = field(default_factory=list)
    spec_logits: list = field(default_factory=list)
    every_row_scored: bool = False  # a verification whose every row's logits are read (runner._build)
    # LoRA: each token's adapter slot [num_tokens] int64 (-1: the base model); None when no token has one.
    lora_slots: torch.Tensor | None = None
    device: torch.device | None = None  # where the forward runs; positions and meta stay on the host until place()
    placed: bool = False

    def place(self) -> Batch:
        """Positions and the metadata's tensors on the forward's device, for an eager forward. Built on
        the host and moved on first use only: a decode step that a CUDA graph replays reads the host
        arrays into its static inputs (one copy in all), so it copies nothing here."""
        if not self.placed and self.device is not None and self.device.type != "cpu":
            dev, m = self.device, self.meta
            self.positions = self.positions.to(dev)
            m.slot_mapping, m.query_start_loc = m.slot_mapping.to(dev), m.query_start_loc.to(dev)
            m.seq_lens, m.block_tables = m.seq_lens.to(dev), m.block_tables.to(dev)
        self.placed = True
        return self

    @property
    def sample_seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.sample_seqs]

    def token_seqs(self) -> list[SeqState]:
        """The sampling rows that get a token (beam rows report candidates and append nothing)."""
        return [s for s in self.sample_seqs if s.sampling.beam_candidates <= 0]


def build_batch(seqs: dict[int, SeqState], block_size: int, device: torch.device, seq_ids: list[int],
                num_new: list[int], in_flight: dict[int, SeqState] | None = None) -> Batch:
    """One pass over the sequences gathers what only they know (their computed counts, new
    tokens and block tables); positions, slots and the padded tables are then computed for
    the whole batch at once. A decode step of 256 sequences costs the device's host thread
    a few hundred microseconds here instead of milliseconds (numpy calls per sequence).

    ``in_flight``: sequences whose next token a step still running samples; where it is an
    input, the row is left for ``launch`` to fill (``Batch.in_flight_inputs``).

    A sequence owed prompt log-probs (``SeqState.prompt_lp_next``) whose prompt positions before
    its computed count were never run here (a prefix-cache hit, blocks swapped in) has those
    positions run again in the chunk's first step, their K/V not written again (slot -1: the cache
    has them): extra work the scheduler did not plan, for requests that ask only
    (``Batch.prompt_rows``)."""
    bs = block_size
    ids: list[int] = []
    begins: list[int] = []
    lens: list[int] = []
    blocks = array("i")  # every sequence's needed block ids, back to back
    blocks_per_seq: list[int] = []
    sample_at: list[int] = []  # batch index of each sampling sequence
    sample_seqs: list[SeqState] = []
    open_rows: list[tuple[int, SeqState, int]] = []  # inputs the step in flight samples
    prompt_rows: list[tuple[SeqState, int, int, int]] = []
    unwritten: list[tuple[int, int]] = []  # (first row, count): positions recomputed, K/V not written
    num_new = list(num_new)
    seq_lora: list[int] = []
    for k, (sid, n) in enumerate(zip(seq_ids, num_new, strict=True)):
        s = seqs[sid]
        seq_lora.append(s.lora_slot)
        begin = s.num_computed_tokens
        end = begin + n
        last = min(end + 1, s.num_prompt_tokens)  # position p scores prompt token p + 1: tokens < last
        if 0 < s.prompt_lp_next < last:
            redo = max(0, begin - (s.prompt_lp_next - 1))  # hit positions the scores need run here
            if redo:
                unwritten.append((len(ids), redo))
                begin -= redo
                num_new[k] = n = n + redo
            prompt_rows.append((s, s.prompt_lp_next, len(ids) + (s.prompt_lp_next - 1 - begin),
                                last - s.prompt_lp_next))
        tokens = s.token_ids
        known = len(tokens)
        length = known + 1 if in_flight and in_flight.get(sid) is s else known  # +1: being sampled
        if end - begin == 1 and end <= known:
            ids.append(tokens[begin])
        else:
            ids.extend(tokens[begin:end])
        if end > known:  # the token in flight is this step's last input: its row is filled at launch
            open_rows.append((len(ids), s, known))
            ids.append(0)
        nb = -(-end // bs)
        blocks.extend(s.block_ids[:nb])
        blocks_per_seq.append(nb)
        begins.append(begin)
        lens.append(end)
        if end == length:
            sample_at.append(len(lens) - 1)
            sample_seqs.append(s)
    num_seqs = len(lens)
    new = np.asarray(num_new, dtype=np.int64)
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(new, out=starts[1:])
    seq_of_token = np.repeat(np.arange(num_seqs), new)
    positions = np.asarray(begins, dtype=np.int64)[seq_of_token] + (np.arange(starts[-1]) - starts[seq_of_token])
    per_seq = np.asarray(blocks_per_seq, dtype=np.int64)
    width = int(per_seq.max())
    block_tables = np.zeros((num_seqs, width), dtype=np.int32)
    # A boolean mask fills row by row, the order ``blocks`` holds them in (a third of the cost of
    # scattering through computed row and column indices).
    block_tables[np.arange(width) < per_seq[:, None]] = np.frombuffer(blocks, np.int32)
    slots = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
    for row, count in unwritten:
        slots[row:row + count] = -1
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots), query_start_loc=torch.from_numpy(starts.astype(np.int32)),
        seq_lens=torch.from_numpy(np.asarray(lens, dtype=np.int32)), block_tables=torch.from_numpy(block_tables),
        max_query_len=max(num_new), max_seq_len=max(lens), query_start_loc_host=starts.tolist(), seq_lens_host=lens)
    lora = torch.from_numpy(np.asarray(seq_lora, dtype=np.int64)[seq_of_token]) if max(seq_lora) >= 0 else None
    return Batch(ids, torch.from_numpy(positions), meta, (starts[1:][sample_at] - 1).tolist(),
                 sample_seqs, open_rows, prompt_rows, host_positions=positions, host_slots=slots,
                 host_tables=block_tables, lora_slots=lora, device=device)
