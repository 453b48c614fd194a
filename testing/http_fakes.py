"""The HTTP front over the fake engine of grpc_fakes.py, served by uvicorn on its own loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
from typing import Any

from scheduler_svc.front.http.app import OpenAIFront
from scheduler_svc.front.http.asgi_app import build_app
from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.serve import HttpServer, start_http_server
from scheduler_svc.front.input.server_limits import ServerLimits
from testing.grpc_fakes import FakeEngine

# A ChatML template as the HTTP tests' fake model's (a message without content renders empty).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class HttpThread:
    def __init__(self, engine: FakeEngine, template: ChatTemplate | None = None,
                 limits: ServerLimits | None = None, http_limits: HttpLimits | None = None, metrics=None,
                 middleware=(), budget=None, ssl=None, **front) -> None:
        """``middleware``, ``budget``: build_app's; ``ssl``: start_http_server's (uvicorn's ssl_* options);
        ``front``: OpenAIFront's other options (tool_options, logprobs_mode)."""
        self.engine = engine
        http_limits = http_limits or HttpLimits()
        self.front = OpenAIFront(engine, engine.tok, template, limits or ServerLimits(), http_limits, metrics, **front)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = build_app(self.front, middleware, budget)
        self.server: HttpServer = self.call(start_http_server(app, "127.0.0.1", 0, ssl, http_limits))
        self.url = f"http://127.0.0.1:{self.server.port}"

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, **kw: Any):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """A raw request (for what the openai client cannot send): (status, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def fresh(self) -> HttpThread:
        """This server as a test finds it: its engine reset and ready, the front not shutting down."""
        self.engine.reset()
        self.engine.ready = True
        self.front.shutting_down = False
        return self

    def stop(self) -> None:
        self.call(self.server.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def seconds_until_closed(sock: socket.socket, limit_s: float, trickle: bytes = b"", every_s: float = 0.3) -> float:
    """Send ``trickle`` every ``every_s`` until the server closes the connection: the seconds that
    took, or ``limit_s`` when it stayed open (what the server sends meanwhile is read and dropped)."""
    start = time.monotonic()
    with contextlib.suppress(OSError):  # sending into a closed connection: closed
        while time.monotonic() - start < limit_s:
            if trickle:
                sock.sendall(trickle)
            sock.settimeout(every_s)
            with contextlib.suppress(TimeoutError):
                if not sock.recv(65536):
                    break
        else:
            return limit_s
    return time.monotonic() - start
