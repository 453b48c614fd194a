"""How large a plan's answer may be: the bound a receiver checks a ``StepResult`` frame's size
against before it parses it (``scheduler_svc/engine/executor_link.py``), computed from what the plan
asks for. It lives apart from the declarations (``messages.py``) because it is arithmetic over them:
each term follows a field of ``StepResult`` and its parts, and tests/unit/wire/test_wire_contract.py
checks that an honest executor's largest answers stay within it.
"""

from __future__ import annotations

from pagedserve.wire import protocol as p


def max_result_bytes(num_scheduled: int, num_sampled: int, logprobs: int = 0, num_logprob_seqs: int = 0,
                     beam_candidates: int = 0, num_beam_seqs: int = 0, prompt_tokens_scored: int = 0,
                     prompt_logprob_entries: int = 0, num_prompt_logprob_seqs: int = 0,
                     decode_steps: int = 1, proposed: int = 0, num_speculating: int = 0,
                     lora_loads: int = 0, num_constrained: int = 0) -> int:
    """The largest encoded StepResult frame (envelope included) a plan can be answered with.

    ``num_scheduled`` sequences computed, ``num_sampled`` of them sampling; of those,
    ``num_logprob_seqs`` report ``logprobs`` alternatives in all (summed over them) and
    ``num_beam_seqs`` beam sequences report ``beam_candidates`` in all; ``num_prompt_logprob_seqs``
    report prompt log-probs for ``prompt_tokens_scored`` prompt tokens with
    ``prompt_logprob_entries`` alternatives in all; ``decode_steps``: the plan's; ``proposed``
    tokens proposed to ``num_speculating`` sequences, each of which may come back with its
    log-probs (counted at ``logprobs`` / ``num_logprob_seqs`` per token); ``lora_loads``: the plan's
    adapter loads, each of which may fail with a reason; ``num_constrained`` sampling sequences
    under a grammar, each of which may be rejected with a reason. A receiver refuses a larger frame before
    parsing it. msgpack sizes are taken at their largest: 5 bytes for an int or a container
    header, 9 for a float, 4 bytes per character of text.
    """
    head = 4 * 5 + 5  # envelope (header, version, kind, tag) and the body's array header
    scalars = 5 + 1 + 9 + 5 + 4 * p.MAX_TEXT_CHARS  # step_id, refused, model_seconds, error
    lists = 5 * 5  # the five list headers
    seq_logprobs = 1 + 5 + 9 + 5 + 5  # header, seq_id, own logprob, the two list headers
    prompt_logprobs = 5 + (1 + 5 + 5 + 4 * 5) * num_prompt_logprob_seqs  # list; header, seq_id, start, lists
    return (head + scalars + lists + 5 * num_scheduled  # failed_seq_ids
            + 10 * num_sampled * decode_steps  # sampled ids and tokens
            + seq_logprobs * (num_logprob_seqs + num_beam_seqs)
            + 14 * (logprobs + num_logprob_seqs + beam_candidates)  # an id and a float per entry
            + prompt_logprobs + 14 * prompt_tokens_scored + 14 * prompt_logprob_entries  # log-prob, rank
            + 5 + 20 * num_speculating + 5 * proposed  # spec_tokens: entries, their ids
            + proposed * (seq_logprobs + 14 * (1 + (logprobs // max(num_logprob_seqs, 1))))
            + 5 + lora_loads * (1 + 5 + 5 + 4 * p.MAX_TEXT_CHARS)  # lora_failures
            + 5 + num_constrained * (1 + 5 + 5 + 4 * p.MAX_REJECTION_CHARS))  # rejected
