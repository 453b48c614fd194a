"""Which fronts of their own may dial the engine core: the public keys of ``--trusted-front-keys``.

The front link's TCP socket is a CURVE server with the scheduler's own key pair, as the executor
link is, under a ZAP domain of its own: a front's connection is admitted only if its key is in
the list (a file of ``KEY name`` lines, or a directory of key files, as ``pagedserve keys`` writes
them). The list is re-read when it changes (checked at each connection: fronts connect rarely);
a key removed admits no new connection. Executors' keys and enrollment tokens admit nothing here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pagedserve.wire.key_files import key_list_signature, read_key_set

log = logging.getLogger(__name__)
FLAG = "--trusted-front-keys"
ZAP_DOMAIN = "pagedserve-fronts"


class FrontKeys:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._signature: tuple | None = None
        self._keys: dict[bytes, str] = {}
        self._reload()  # (now: a bad list fails start-up, naming the flag)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP check of one connection (pyzmq's curve callback: z85 key)."""
        try:
            self._reload()
        except ValueError as exc:  # keep the last good list; say why
            log.warning("%s: %s (keeping the last list read)", FLAG, exc)
        admitted = client_key in self._keys
        if not admitted:
            log.warning("refused a front link connection: key %s is not in %s", client_key.decode(errors="replace"),
                        FLAG)
        return admitted

    def _reload(self) -> None:
        signature = key_list_signature(self.path)
        if signature != self._signature:
            self._keys = read_key_set(self.path, FLAG)
            self._signature = signature
            log.info("%d trusted front keys (%s)", len(self._keys), self.path)
