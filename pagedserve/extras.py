"""A clear error when a service runs from an install that lacks its extra.

``pip install pagedserve`` gives the client; each service needs its extra
(``pagedserve[scheduler]``, ``pagedserve[executor]``). Without it the console
script would die on an ImportError deep in an import chain; instead the
service's package says which extra to install.
"""

from __future__ import annotations

import importlib.util


def require(extra: str, modules: tuple[str, ...]) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"this part of pagedserve needs the '{extra}' extra, which is not installed "
                          f"(missing: {', '.join(missing)}): pip install 'pagedserve[{extra}]'")
