"""The front's decode fast path streams exactly what the general path does.

Most updates take ``FrontStreams.stream_now``'s inlined path (one choice, one token, no
logprobs, no stop strings); the first token, merged steps, a finish and every request with
stop strings take ``RequestStream.apply``. Fed the same tokens, both must give the same text
(``decode`` of the outputs: multi-byte characters split across tokens included), the same
usage and the same inter-token-latency count."""

from __future__ import annotations

import pytest
from grpc_fakes import make_tokenizer

from pagedserve.engine_api import FinishReason, GenerationRequest, RequestParams, RequestUpdate, SeqUpdate
from pagedserve.wire import SamplingParams
from scheduler_svc.front.output.deltas import RequestStream
from scheduler_svc.front.output.mailbox import Tracked
from scheduler_svc.front.streams import FrontStreams
from scheduler_svc.telemetry.metrics import Metrics

TEXT = "Grüße aus München 🙂🚀 and 日本語 too; plain words as well."


def _stream(tok, rid: str, stop: list[str]) -> Tracked:
    req = GenerationRequest(rid, tok.encode("Hi").ids, RequestParams(
        max_tokens=500, sampling=SamplingParams(temperature=0.0), stop=stop))
    return Tracked(RequestStream(req, tok, num_choices=1), core_id=rid)


class NoCore:
    """A front's core that is never asked anything in these tests (no stop string matches)."""

    def __getattr__(self, name):
        raise AssertionError(f"the core was asked {name}")


def _front(tok, metrics, tracked: Tracked) -> FrontStreams:
    front = FrontStreams(NoCore(), tok, metrics=metrics)
    front.by_core_id[tracked.core_id] = tracked
    front.tracked[tracked.core_id] = tracked
    return front


@pytest.mark.parametrize("merge_every", [1, 3])
def test_fast_and_general_paths_stream_the_same_text_usage_and_metrics(merge_every, monkeypatch):
    applied: dict[str, int] = {"fast": 0, "general": 0}  # updates that went through RequestStream.apply
    general = RequestStream.apply

    def counted(self, update, now=None):
        applied[update.request_id] += 1
        return general(self, update, now)

    monkeypatch.setattr(RequestStream, "apply", counted)
    tok = make_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    # "fast": eligible for the inlined path; "general": a stop string that never matches keeps
    # it on RequestStream.apply for every token.
    tracked = {"fast": _stream(tok, "fast", []), "general": _stream(tok, "general", ["\x00never"])}
    metrics = {name: Metrics() for name in tracked}
    fronts = {name: _front(tok, metrics[name], t) for name, t in tracked.items()}
    updates = 0
    for at in range(0, len(ids), merge_every):
        chunk = ids[at:at + merge_every]
        last = at + merge_every >= len(ids)
        updates += 1
        for name in tracked:
            upd = RequestUpdate(name, [SeqUpdate(0, list(chunk), None, FinishReason.LENGTH if last else None)],
                                last, 2)
            fronts[name].stream_now([upd])
    assert tracked["general"].stream.fast is None
    assert applied["general"] == updates
    # One token per update: only the first and the finishing one take the general path.
    assert applied["fast"] == (2 if merge_every == 1 else updates)
    texts = {}
    for name, t in tracked.items():
        outs = t.outbox  # (nobody waited: every output was kept)
        texts[name] = "".join(c.text for o in outs for c in o.choices)
        assert [i for o in outs for c in o.choices for i in c.token_ids] == ids
        assert outs[-1].finished and outs[-1].usage.completion_tokens == len(ids)
        assert outs[-1].choices[-1].finish_reason == FinishReason.LENGTH
        value = metrics[name].registry.get_sample_value
        assert value("pagedserve:generation_tokens_total") == len(ids)
        assert value("pagedserve:inter_token_latency_seconds_count") == len(ids) - len(ids[:merge_every])
    assert texts["fast"] == texts["general"] == tok.decode(ids)


def test_an_abort_ends_the_fast_path():
    tok = make_tokenizer()
    t = _stream(tok, "r", [])
    front = _front(tok, None, t)
    for tid in tok.encode("two words", add_special_tokens=False).ids:
        front.stream_now([RequestUpdate("r", [SeqUpdate(0, [tid])], False, 2)])
    assert t.stream.fast is not None
    t.stream.abort()
    assert t.stream.fast is None
