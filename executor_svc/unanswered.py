"""Telling "no scheduler there" from "the scheduler ignores this executor's id" on a silent dial.

The scheduler's ROUTER keeps the first connection of an executor id and ignores a second one
(no ROUTER_HANDOVER: a live executor's id cannot be taken over, ``scheduler_svc/engine/executor_link.py``).
libzmq does that below the application: the second connection completes the ZeroMQ handshake
(and CURVE), then its messages are held unread, and the scheduler sees nothing it could log
(neither its ROUTER nor a monitor of it names the id). Only the second executor can tell: a
socket monitor shows the handshake succeeded, yet no answer to its own Handshake ever came. After
:data:`WARN_AFTER` such dials in a row (one is normal: a restarted executor waits for the
scheduler to drop its old connection) it says that its ``--executor-id`` is probably in use.
"""

from __future__ import annotations

import logging

import zmq

log = logging.getLogger(__name__)
WARN_AFTER = 3  # consecutive dials the scheduler's socket took but never answered


class UnansweredDials:
    def __init__(self, executor_id: str) -> None:
        self.executor_id = executor_id
        self.count = 0  # consecutive dials taken but unanswered
        self._monitor: zmq.Socket | None = None
        self._sock: zmq.Socket | None = None

    def watch(self, sock: zmq.Socket) -> None:
        """Watch the connection ``sock`` is about to dial (the socket before it is forgotten)."""
        self.close()
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def answered(self) -> None:
        self.count = 0

    def silent(self) -> None:
        """The dial got no answer in time: count it if the scheduler's socket took it, and say why
        that may be once it keeps happening."""
        taken = False
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor.recv_multipart()
            taken = True
        self.count = self.count + 1 if taken else 0
        if self.count >= WARN_AFTER:
            log.error("the scheduler took this connection %d times in a row but never answered its handshake: "
                      "--executor-id %s is probably in use by another executor connected to it (the scheduler "
                      "ignores a second connection with a live id); give each executor its own id",
                      self.count, self.executor_id)

    def close(self) -> None:
        if self._monitor is not None:
            if not self._sock.closed:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._monitor = self._sock = None
