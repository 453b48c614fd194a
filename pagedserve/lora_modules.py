"""LoRA adapters as the scheduler and the fronts know them: a name, a PEFT directory, its shape.

Torch-free (the scheduler reads only JSON): ``--lora-modules`` entries are parsed here, and each
adapter's ``adapter_config.json`` and the header of its ``adapter_model.safetensors`` are checked
at start, so that a bad adapter is refused with its reason before any request names it. The
executor loads the weights themselves (``executor_svc/lora``) and checks them against the base
model's shapes.

An adapter changes every K/V it touches, so its prompt blocks hash under a root of its own
(``pagedserve.kv_blocks.chain_root``): the same prompt under two adapters shares no cached block.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 256  # --max-lora-rank's ceiling, as vLLM's
MAX_NAME_CHARS = 128
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 64 << 20  # a safetensors header is JSON: bounded before it is read
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                          r"lora_([AB])(?:\.default)?\.weight$")
_DTYPES = ("F32", "BF16", "F16")


class LoraConfigError(ValueError):
    """An adapter or a --lora-modules entry that cannot be served; the message says why."""


@dataclass(frozen=True)
class LoraModule:
    name: str  # what a request's ``model`` field names
    path: Path  # the PEFT directory (as every executor sees it: a shared volume)
    rank: int
    targets: tuple[str, ...]
    base_model: str | None = None  # base_model_name_or_path, when the adapter says


def is_usable_name(name: str) -> bool:
    """A model's or an adapter's name in the API: 1 to MAX_NAME_CHARS printable characters, no
    leading or trailing space."""
    return 0 < len(name) <= MAX_NAME_CHARS and name.isprintable() and name == name.strip()


def check_name(name: str) -> str:
    if not is_usable_name(name):
        raise LoraConfigError(f"LoRA adapter name {name[:MAX_NAME_CHARS]!r}: 1 to {MAX_NAME_CHARS} printable "
                              "characters, no leading or trailing space")
    return name


def check_not_base_model(name: str, model_name: str) -> str:
    """``name`` unless it is the served model's own: a request naming it gets the base model (it is
    looked up first), so an adapter under that name could never be reached."""
    if name == model_name:
        raise LoraConfigError(f"LoRA adapter name {name!r} is the served model's name (requests naming it get "
                              "the base model); choose another")
    return name


def split_lora_modules(values: tuple[str, ...] | list[str]) -> list[str]:
    """The entries of ``--lora-modules``' values: each value one entry, except that a value holding
    several (``PAGEDSERVE_LORA_MODULES``, one environment variable) is split: a JSON list into its
    items, else ``name=path`` entries at whitespace."""
    out: list[str] = []
    for v in values:
        v = v.strip()
        if v.startswith("["):
            try:
                items = json.loads(v)
            except json.JSONDecodeError as e:
                raise LoraConfigError(f"--lora-modules {v[:80]!r}: not JSON ({e.msg})") from None
            if not isinstance(items, list):
                raise LoraConfigError(f"--lora-modules {v[:80]!r}: expected a JSON list")
            out += [json.dumps(i) if isinstance(i, dict) else str(i) for i in items]
        elif v.startswith("{"):
            out.append(v)
        else:
            out += v.split()
    return out


def parse_lora_module(text: str) -> tuple[str, Path, str | None]:
    """One ``--lora-modules`` entry, ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}`` -> (name, path, base or None)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise LoraConfigError(f"--lora-modules {text[:80]!r}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise LoraConfigError(f"--lora-modules {text[:80]!r}: a JSON entry needs string fields 'name' and 'path'")
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise LoraConfigError(f"--lora-modules {text[:80]!r}: unknown field(s) {sorted(unknown)}")
        base = obj.get("base_model_name")
        return check_name(obj["name"]), Path(obj["path"]), base if isinstance(base, str) else None
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise LoraConfigError(f"--lora-modules {text[:80]!r}: expected name=path or a JSON object")
    return check_name(name), Path(path), None


def inspect_adapter(name: str, path: Path, max_rank: int) -> LoraModule:
    """The adapter at ``path`` checked as far as its files go: config, rank, targets, tensor names
    and dtypes (not the values: the executor reads those). Raises LoraConfigError naming the
    problem."""
    where = f"LoRA adapter {name!r} ({path})"
    if not path.is_dir():
        raise LoraConfigError(f"{where}: no such directory")
    cfg = _read_config(path / CONFIG_FILE, where)
    rank, targets = _rank(cfg, where, max_rank), _targets(cfg, where)
    for key, ok in (("use_dora", False), ("bias", "none")):
        if cfg.get(key, ok) not in (ok, None):
            raise LoraConfigError(f"{where}: {key}={cfg[key]!r} is not supported (only {ok!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            raise LoraConfigError(f"{where}: {key} is not supported")
    _check_tensors(path / WEIGHTS_FILE, where, targets, rank)
    base = cfg.get("base_model_name_or_path")
    return LoraModule(name, path, rank, targets, base if isinstance(base, str) and base else None)


def _read_config(file: Path, where: str) -> dict:
    try:
        with open(file, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise LoraConfigError(f"{where}: cannot read {CONFIG_FILE} ({e.strerror})") from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise LoraConfigError(f"{where}: {CONFIG_FILE} is over {_MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoraConfigError(f"{where}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraConfigError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraConfigError(f"{where}: peft_type {cfg['peft_type']!r}, expected 'LORA'")
    return cfg


def _rank(cfg: dict, where: str, max_rank: int) -> int:
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraConfigError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraConfigError(f"{where}: rank {r} is above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha == alpha:
        raise LoraConfigError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return r


def _targets(cfg: dict, where: str) -> tuple[str, ...]:
    t = cfg.get("target_modules")
    names = [t] if isinstance(t, str) else t
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise LoraConfigError(f"{where}: target_modules must name modules, got {t!r}")
    bad = sorted(set(names) - set(TARGET_MODULES))
    if bad:
        raise LoraConfigError(f"{where}: target module(s) {bad} are not in the base model "
                              f"(a LoRA may target {', '.join(TARGET_MODULES)})")
    return tuple(m for m in TARGET_MODULES if m in names)


def _check_tensors(file: Path, where: str, targets: tuple[str, ...], rank: int) -> None:
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            size = file.stat().st_size
            if len(head) < 8:
                raise LoraConfigError(f"{where}: {WEIGHTS_FILE} is truncated")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER_BYTES, size - 8):
                raise LoraConfigError(f"{where}: {WEIGHTS_FILE} is corrupt (header of {n} bytes in a file of {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise LoraConfigError(f"{where}: cannot read {WEIGHTS_FILE} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LoraConfigError(f"{where}: {WEIGHTS_FILE} is corrupt (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise LoraConfigError(f"{where}: {WEIGHTS_FILE} is corrupt (its header is not an object)")
    seen = set()
    for key, info in header.items():
        if key == "__metadata__":
            continue
        m = _TENSOR_NAME.match(key)
        if m is None or m.group(3) not in targets:
            raise LoraConfigError(f"{where}: tensor {key[:120]!r} is not a LoRA weight of a target module")
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            raise LoraConfigError(f"{where}: tensor {key[:120]!r} has dtype "
                                  f"{info.get('dtype') if isinstance(info, dict) else None!r}; expected one of {_DTYPES}")
        shape = info.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and shape[0 if m.group(4) == "A" else 1] == rank):
            raise LoraConfigError(f"{where}: tensor {key[:120]!r} has shape {shape!r}, not rank {rank}")
        start, end = (info.get("data_offsets") or [0, -1])[:2]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size - 8 - n):
            raise LoraConfigError(f"{where}: {WEIGHTS_FILE} is truncated (tensor {key[:120]!r} ends past it)")
        seen.add(m.group(3))
    if not seen:
        raise LoraConfigError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
