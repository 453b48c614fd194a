"""The one table that turns the engine's errors into what clients are told, on both fronts."""

from __future__ import annotations

import logging

import grpc
import msgspec
import pytest

from pagedserve.engine_api import EngineError, ErrorKind, RequestUpdate
from scheduler_svc.front.api_errors import GRPC_CODE_OF_STATUS
from scheduler_svc.front.output.status_codes import STATUS_OF_KIND, client_status


@pytest.mark.parametrize("error,grpc_code,status,code", [
    (EngineError(ErrorKind.QUEUE_FULL, "256 queued"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "queue_full"),
    (EngineError(ErrorKind.NO_EXECUTOR, "none ready"), grpc.StatusCode.UNAVAILABLE, 503, "no_executor"),
    (EngineError(ErrorKind.FAILED, "executor e1 failed the step"), grpc.StatusCode.INTERNAL, 500, "request_failed"),
    (EngineError(ErrorKind.INVALID, "structured outputs: the grammar does not compile here"),
     grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request"),
    (EngineError(ErrorKind.DEADLINE, "its deadline passed 2.0s after it arrived"), grpc.StatusCode.DEADLINE_EXCEEDED,
     408, "deadline_exceeded"),
    (ZeroDivisionError("a bug"), grpc.StatusCode.INTERNAL, 500, "internal_error"),
])
def test_each_engine_error_has_one_answer_on_both_fronts(error, grpc_code, status, code):
    r = client_status(error, "req-1")
    assert (grpc.StatusCode[r.grpc_code], r.http_status, r.api_code) == (grpc_code, status, code)
    # The HTTP front counts its rejections under the gRPC name of its status: the same one.
    assert GRPC_CODE_OF_STATUS[r.http_status] == r.grpc_code


def test_every_kind_has_a_status():
    assert set(STATUS_OF_KIND) == set(ErrorKind)


def test_the_kind_travels_as_the_same_ints_on_the_tier_link():
    assert [int(k) for k in (ErrorKind.FAILED, ErrorKind.NO_EXECUTOR, ErrorKind.QUEUE_FULL)] == [0, 1, 2]
    raw = msgspec.msgpack.encode(RequestUpdate("r", [], True, 3, error="full", error_kind=ErrorKind.QUEUE_FULL))
    assert msgspec.msgpack.decode(raw) == ["r", [], True, 3, 0, "full", 2, None, 0, 0]  # positional, a plain int
    back = msgspec.msgpack.decode(raw, type=RequestUpdate)
    assert back.error_kind is ErrorKind.QUEUE_FULL
    assert client_status(EngineError(back.error_kind, back.error), "r").http_status == 429


def test_messages_say_what_happened_but_a_bug_shows_only_its_type():
    assert client_status(EngineError(ErrorKind.QUEUE_FULL, "256 queued, the limit is 256"), "r").message == \
        "request queue is full: 256 queued, the limit is 256"
    assert client_status(KeyError("secret internals"), "r").message == "internal error (KeyError)"


def test_a_failed_request_is_a_warning_and_a_bug_is_logged_with_its_traceback(caplog):
    caplog.set_level(logging.WARNING, logger="scheduler_svc.front.output.status_codes")
    client_status(EngineError(ErrorKind.FAILED, "executor e1 failed the step"), "req-7")
    try:
        raise ZeroDivisionError("a bug")
    except ZeroDivisionError as e:
        client_status(e, "req-8")
    (warn, err) = caplog.records
    assert warn.levelname == "WARNING" and "req-7" in warn.getMessage() and warn.exc_info is None
    assert err.levelname == "ERROR" and "req-8" in err.getMessage() and err.exc_info[0] is ZeroDivisionError


def test_subclasses_of_the_engine_error_map_by_their_kind():
    class Overloaded(EngineError):
        pass

    assert client_status(Overloaded(ErrorKind.QUEUE_FULL, "x"), "r").http_status == 429
