"""A front turns the core's token updates into client deltas (``FrontStreams.stream_now`` over
``RequestStream.apply``): text, stop strings, log-probs, several choices, finish reasons, usage,
the per-token metrics, and what the core is told when a stop string ends a choice.

Every case goes through the one path; the decode case (one token, one plain choice) is a branch
of it, so each test below is fed both one token per update and several at once."""

from __future__ import annotations

import pytest

from pagedserve.engine_api import (
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestParams,
    RequestUpdate,
    SeqUpdate,
    TokenLogprob,
)
from pagedserve.wire import SamplingParams
from scheduler_svc.front.output.deltas import RequestStream
from scheduler_svc.front.output.mailbox import Tracked
from scheduler_svc.front.streams import FrontStreams
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import make_tokenizer

TEXT = "Grüße aus München 🙂🚀 and 日本語 too; plain words as well."
TOK = make_tokenizer()
EOS_ID = 1  # make_tokenizer's </s>


class Core:
    """A front's core that records what the front tells it."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.finished_choices: list[tuple[str, int]] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def finish_choice(self, request_id: str, index: int) -> None:
        self.finished_choices.append((request_id, index))


def _front(metrics: Metrics | None = None, n: int = 1, stop: tuple[str, ...] = (), include_stop: bool = False,
           skip_special_tokens: bool = True) -> tuple[FrontStreams, Tracked, Core]:
    core = Core()
    front = FrontStreams(core, TOK, metrics=metrics)  # type: ignore[arg-type]
    req = GenerationRequest("r", TOK.encode("Hi").ids, RequestParams(
        max_tokens=500, sampling=SamplingParams(temperature=0.0), n=n, stop=list(stop),
        include_stop_str_in_output=include_stop, skip_special_tokens=skip_special_tokens))
    t = Tracked(RequestStream(req, TOK, num_choices=n, standalone_texts=front.standalone_texts), core_id="r")
    front.by_core_id["r"] = front.tracked["r"] = t
    return front, t, core


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def _feed(front: FrontStreams, ids: list[int], per_update: int, index: int = 0, finish: FinishReason | None = None,
          logprobs: bool = False, cached: int = 0) -> None:
    """``ids`` for choice ``index``, ``per_update`` at a time; the last update carries ``finish``."""
    for at in range(0, len(ids), per_update):
        chunk = ids[at:at + per_update]
        last = at + per_update >= len(ids)
        lps = [TokenLogprob(tok, -0.5 - tok) for tok in chunk] if logprobs else None
        front.stream_now([RequestUpdate("r", [SeqUpdate(index, chunk, lps, finish if last else None)],
                                        last and finish is not None, 2, cached)])


def _text(outs: list[RequestOutput], index: int = 0) -> str:
    return "".join(c.text for o in outs for c in o.choices if c.index == index)


def _tokens(outs: list[RequestOutput], index: int = 0) -> list[int]:
    return [i for o in outs for c in o.choices if c.index == index for i in c.token_ids]


@pytest.mark.parametrize("stop", [(), ("\x00never",)], ids=["no stop strings", "a stop string that never matches"])
@pytest.mark.parametrize("per_update", [1, 3])
def test_text_usage_and_metrics_of_a_whole_request(per_update, stop):
    metrics = Metrics()
    front, t, core = _front(metrics, stop=stop)
    ids = _ids(TEXT)
    _feed(front, ids, per_update, finish=FinishReason.LENGTH, cached=16)
    outs = t.outbox  # (nobody waited: every output was kept)
    assert _text(outs) == TOK.decode(ids)  # multi-byte characters split across tokens included
    assert _tokens(outs) == ids
    assert outs[-1].finished and outs[-1].choices[-1].finish_reason == FinishReason.LENGTH
    assert outs[-1].choices[-1].stop_reason is None
    assert (outs[-1].usage.completion_tokens, outs[-1].usage.cached_prompt_tokens) == (len(ids), 16)
    assert not any(o.finished for o in outs[:-1]) and "r" not in front.by_core_id
    value = metrics.registry.get_sample_value
    assert value("pagedserve:generation_tokens_total") == len(ids)
    assert value("pagedserve:inter_token_latency_seconds_count") == len(ids) - len(ids[:per_update])
    assert value("pagedserve:time_to_first_token_seconds_count") == 1
    assert value("pagedserve:request_success_total", {"finished_reason": "length"}) == 1
    assert core.aborted == [] and core.finished_choices == []  # the core ended it itself


@pytest.mark.parametrize("per_update", [1, 4, 100])
@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_across_tokens_ends_the_request_and_frees_it(per_update, include_stop):
    metrics = Metrics()
    front, t, core = _front(metrics, stop=("STOP here",), include_stop=include_stop)
    ids = _ids("Some text then STOP here and more text after it")
    _feed(front, ids, per_update)  # the core never finishes it: only the stop string can
    outs = t.outbox
    assert _text(outs) == "Some text then " + ("STOP here" if include_stop else "")
    assert outs[-1].finished and outs[-1].choices[-1].finish_reason == FinishReason.STOP
    assert outs[-1].choices[-1].stop_reason == "STOP here"  # (vLLM's stop_reason: the string matched)
    streamed = _tokens(outs)
    assert streamed == ids[:len(streamed)] and len(streamed) < len(ids)  # nothing after the stop
    assert outs[-1].usage.completion_tokens == len(streamed)
    assert core.aborted == ["r"]  # its last choice ended here: the core frees it at once
    assert "r" not in front.by_core_id
    assert metrics.registry.get_sample_value("pagedserve:request_success_total", {"finished_reason": "stop"}) == 1


def test_text_that_may_start_a_stop_string_is_held_and_released_at_the_end():
    front, t, _ = _front(stop=("xyz",))
    front.stream_now([RequestUpdate("r", [SeqUpdate(0, _ids("ab"))], False, 2)])
    front.stream_now([RequestUpdate("r", [SeqUpdate(0, _ids(" x"))], False, 2)])
    assert _text(t.outbox) == "ab "  # "x" may begin "xyz"... (held)
    front.stream_now([RequestUpdate("r", [SeqUpdate(0, [*_ids("y"), EOS_ID], None, FinishReason.EOS)], True, 2)])
    assert _text(t.outbox) == "ab xy"  # ...and the end releases it
    assert t.outbox[-1].choices[-1].finish_reason == FinishReason.EOS


@pytest.mark.parametrize("per_update", [1, 3])
@pytest.mark.parametrize("stop", [(), ("zzz",)])
@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("finish", [FinishReason.STOP, FinishReason.EOS])
def test_the_token_that_ends_a_choice_is_streamed_without_its_text(per_update, stop, include_stop, finish):
    """A stop token (stop_token_ids) or EOS ends the choice: its id and log-prob are streamed, its text is
    not unless include_stop_str_in_output asks for it, as vLLM does (with skip_special_tokens=false an EOS
    would otherwise show as "</s>"; a stop token id of ordinary text would end the answer with that text)."""
    front, t, _ = _front(stop=stop, include_stop=include_stop, skip_special_tokens=False)
    end = EOS_ID if finish == FinishReason.EOS else _ids(",")[0]
    ids = [*_ids("plain words"), end]
    _feed(front, ids, per_update, finish=finish, logprobs=True)
    outs = t.outbox
    assert _text(outs) == "plain words" + (TOK.decode([end], skip_special_tokens=False) if include_stop else "")
    assert _tokens(outs) == ids and [lp.token_id for o in outs for c in o.choices for lp in c.logprobs] == ids
    assert outs[-1].finished and outs[-1].choices[-1].finish_reason == finish
    assert outs[-1].choices[-1].stop_reason == (end if finish == FinishReason.STOP else None)  # (EOS: none, as vLLM)
    assert outs[-1].usage.completion_tokens == len(ids)


@pytest.mark.parametrize("per_update", [1, 3])
@pytest.mark.parametrize("stop", [(), ("zzz",)])
def test_log_probs_come_with_their_tokens(per_update, stop):
    front, t, _ = _front(stop=stop)
    ids = _ids("plain words as well")
    _feed(front, ids, per_update, finish=FinishReason.LENGTH, logprobs=True)
    got = [lp for o in t.outbox for c in o.choices for lp in c.logprobs]
    assert [(lp.token_id, lp.logprob) for lp in got] == [(tok, -0.5 - tok) for tok in ids]


def test_log_probs_of_tokens_after_a_stop_string_are_dropped():
    front, t, _ = _front(stop=("cat",))
    ids = _ids("the cat sat")
    front.stream_now([RequestUpdate("r", [SeqUpdate(0, ids, [TokenLogprob(tok, -1.0) for tok in ids])], False, 2)])
    (out,) = t.outbox
    (choice,) = out.choices
    assert choice.finish_reason == FinishReason.STOP and choice.text == "the "
    assert [lp.token_id for lp in choice.logprobs] == choice.token_ids == ids[:len(choice.token_ids)]
    assert len(choice.token_ids) < len(ids)


def test_several_choices_stream_apart_and_a_stop_string_ends_one_alone():
    metrics = Metrics()
    front, t, core = _front(metrics, n=2, stop=("END",))
    a, b = _ids("first END ignored"), _ids("second choice goes on")
    steps = max(len(a), len(b))
    for i in range(steps):
        seqs = [SeqUpdate(c, [ids[i]]) for c, ids in ((0, a), (1, b)) if i < len(ids)]
        if i == len(b) - 1:
            seqs[-1].finish_reason = FinishReason.LENGTH
        front.stream_now([RequestUpdate("r", seqs, False, 2)])
    outs = t.outbox
    assert _text(outs, 0) == "first " and _text(outs, 1) == "second choice goes on"
    assert core.finished_choices == [("r", 0)]  # choice 0 ended here: the core frees it alone
    assert _tokens(outs, 1) == b and len(_tokens(outs, 0)) < len(a)  # choice 0's late tokens dropped
    last = outs[-1]
    assert last.finished and last.usage.completion_tokens == len(_tokens(outs, 0)) + len(b)
    assert {c.index: c.finish_reason for o in outs for c in o.choices if c.finish_reason} == \
        {0: FinishReason.STOP, 1: FinishReason.LENGTH}
    assert core.aborted == []  # the last choice ended at the core: nothing more to free
    assert metrics.registry.get_sample_value("pagedserve:generation_tokens_total") == last.usage.completion_tokens


def test_an_error_update_ends_the_stream_after_the_tokens_it_had():
    front, t, _ = _front()
    _feed(front, _ids("two words"), 1)
    front.stream_now([RequestUpdate("r", [], True, 2, error="its executor was lost")])
    *outs, err = t.outbox
    assert _text(outs) == "two words" and isinstance(err, Exception) and "executor was lost" in str(err)
    assert t.ended and "r" not in front.by_core_id


def test_a_token_that_arrives_after_an_abort_is_not_streamed():
    front, t, _ = _front()
    _feed(front, _ids("two words"), 1)  # (past the first token: the decode case)
    out = t.stream.abort()
    assert out.finished and out.choices[0].finish_reason == FinishReason.ABORTED
    late, _ = t.stream.apply(RequestUpdate("r", [SeqUpdate(0, _ids(" more")[:1])], False, 2), 1.0)  # one token
    assert late.choices == [] and t.stream.outputs[0] == _ids("two words")


@pytest.mark.parametrize("per_update", [1, 3])
def test_usage_keeps_the_latest_speculative_totals(per_update):
    """The core puts a request's totals on the updates of the steps that verified its proposals
    (one token each when all were rejected: the decode case must keep them too)."""
    front, t, _ = _front(Metrics())
    ids = _ids(TEXT)
    for at in range(0, len(ids), per_update):
        last = at + per_update >= len(ids)
        totals = (3 * (at + 1), at + 1) if at < len(ids) // 2 else (0, 0)  # later steps did not speculate
        front.stream_now([RequestUpdate("r", [SeqUpdate(0, ids[at:at + per_update], None,
                                                        FinishReason.LENGTH if last else None)], last, 2, 0,
                                        spec_proposed_tokens=totals[0], spec_accepted_tokens=totals[1])])
    usage = t.outbox[-1].usage
    want = max(at for at in range(0, len(ids), per_update) if at < len(ids) // 2) + 1
    assert (usage.spec_proposed_tokens, usage.spec_accepted_tokens) == (3 * want, want)


@pytest.mark.parametrize("per_update", [1, 2])
def test_each_choice_of_several_gets_the_whole_gap_as_its_inter_token_latency(monkeypatch, per_update):
    """n > 1: a step brings each choice its own tokens; a token's latency is the gap since its choice's
    last one (spread over the tokens a choice got at once), not that gap split among the choices."""
    clock = iter([10.0, 10.5, 11.5])  # one reading per step
    monkeypatch.setattr("scheduler_svc.front.streams.time.monotonic", lambda: next(clock))
    metrics = Metrics()
    front, t, core = _front(metrics, n=2)
    ids = _ids("one two three four five six")
    for step in range(3):
        chunk = ids[step * per_update:(step + 1) * per_update]
        front.stream_now([RequestUpdate("r", [SeqUpdate(0, chunk), SeqUpdate(1, chunk)], False, 2)])
    value = metrics.registry.get_sample_value
    assert value("pagedserve:inter_token_latency_seconds_count") == 2 * 2 * per_update  # (first step: none)
    # each choice: gaps of 0.5 s and 1.0 s, each spread over the tokens it brought
    assert value("pagedserve:inter_token_latency_seconds_sum") == pytest.approx(2 * (0.5 + 1.0))
