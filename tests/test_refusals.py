"""The one table that turns engine errors into gRPC and HTTP answers."""

from __future__ import annotations

import logging

import grpc
import pytest

from pagedserve.engine_api import NoExecutor, QueueFull, RequestFailed
from scheduler_svc.front.api_errors import GRPC_CODE_OF_STATUS
from scheduler_svc.front.output.status_codes import refusal


@pytest.mark.parametrize("error,grpc_code,status,code", [
    (QueueFull("256 queued"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "queue_full"),
    (NoExecutor("none ready"), grpc.StatusCode.UNAVAILABLE, 503, "no_executor"),
    (RequestFailed("executor e1 failed the step"), grpc.StatusCode.INTERNAL, 500, "request_failed"),
    (ZeroDivisionError("a bug"), grpc.StatusCode.INTERNAL, 500, "internal_error"),
])
def test_each_engine_error_has_one_answer_on_both_fronts(error, grpc_code, status, code):
    r = refusal(error, "req-1")
    assert (grpc.StatusCode[r.grpc_code], r.http_status, r.api_code) == (grpc_code, status, code)
    # The HTTP front counts its rejections under the gRPC name of its status: the same one.
    assert GRPC_CODE_OF_STATUS[r.http_status] == r.grpc_code


def test_messages_say_what_happened_but_a_bug_shows_only_its_type():
    assert refusal(QueueFull("256 queued, the limit is 256"), "r").message == \
        "request queue is full: 256 queued, the limit is 256"
    assert refusal(KeyError("secret internals"), "r").message == "internal error (KeyError)"


def test_a_failed_request_is_a_warning_and_a_bug_is_logged_with_its_traceback(caplog):
    caplog.set_level(logging.WARNING, logger="scheduler_svc.front.output.status_codes")
    refusal(RequestFailed("executor e1 failed the step"), "req-7")
    try:
        raise ZeroDivisionError("a bug")
    except ZeroDivisionError as e:
        refusal(e, "req-8")
    (warn, err) = caplog.records
    assert warn.levelname == "WARNING" and "req-7" in warn.getMessage() and warn.exc_info is None
    assert err.levelname == "ERROR" and "req-8" in err.getMessage() and err.exc_info[0] is ZeroDivisionError


def test_subclasses_of_known_errors_map_like_their_base():
    class Overloaded(QueueFull):
        pass

    assert refusal(Overloaded("x"), "r").http_status == 429
