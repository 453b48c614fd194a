"""The LoRA adapters an engine core serves: those of ``--lora-modules``, and those loaded or
unloaded at run time (``/v1/load_lora_adapter``, with ``--allow-runtime-lora-updating``).

Each load of a name gets an id (0 for the adapters given at start), which requests carry
(``GenerationRequest.lora_id``): a name unloaded and loaded again from other files is another
adapter, with its own prefix-cache chain and its own executor slots (``lora_key``), so nothing
computed under the old weights serves the new ones. Unloading takes the name away from new
requests at once; requests already running keep their slot, and their adapter, to the end.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from pagedserve.kv_blocks import lora_key
from pagedserve.lora_modules import LoraConfigError, LoraModule, check_name, inspect_adapter


class LoraRegistry:
    def __init__(self, modules: tuple[LoraModule, ...], max_rank: int) -> None:
        self.max_rank = max_rank
        self.paths: dict[str, str] = {}  # lora_key -> the adapter's directory (every scheduler reads it)
        self.ids: dict[str, int] = {}  # name -> the id of its current load
        self._next_id = itertools.count(1)
        for m in modules:
            self._put(m, 0)

    def _put(self, m: LoraModule, lora_id: int) -> None:
        self.paths[lora_key(m.name, lora_id)] = str(m.path)
        self.ids[m.name] = lora_id

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.ids)

    def load(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name``; LoraConfigError (nothing changed) if its files
        are bad or the name is taken."""
        self.add(inspect_adapter(check_name(name), Path(path), self.max_rank))

    def add(self, module: LoraModule) -> None:
        """Serve an adapter already checked (``inspect_adapter``); LoraConfigError if its name is taken."""
        check_name(module.name)
        if module.name in self.ids:
            raise LoraConfigError(f"the LoRA adapter {module.name!r} is already loaded; unload it first")
        self._put(module, next(self._next_id))

    def unload(self, name: str) -> None:
        """KeyError if ``name`` is not served."""
        lora_id = self.ids.pop(name)
        del self.paths[lora_key(name, lora_id)]
