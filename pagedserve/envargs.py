"""Command-line flags that can also come from ``PAGEDSERVE_*`` environment variables.

Kubernetes passes configuration through a ConfigMap as environment variables;
the command line still wins. A few flags also read the vLLM variable of the same
meaning (``VLLM_ENV``), so a vLLM user's environment keeps working. This is the
only place either service reads the environment for its flags. :func:`read_flag_file`
reads the small secret files flags name (the cluster secret, the API keys), with
the same checks for both.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from pathlib import Path

ENV_PREFIX = "PAGEDSERVE_"
# vLLM's variables a vLLM user already sets, read for the flag of the same meaning when PAGEDSERVE_<FLAG> is unset.
VLLM_ENV = {"--batch-invariant": "VLLM_BATCH_INVARIANT",
            "--allow-runtime-lora-updating": "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}


def env_name(option: str) -> str:
    """``--max-num-seqs`` -> ``PAGEDSERVE_MAX_NUM_SEQS``."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def parse_with_env(parser: argparse.ArgumentParser, argv: list[str] | None,
                   environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; flags not given there fall back to ``PAGEDSERVE_<FLAG>``.

    Environment values go through the same type conversion and choices checks
    as command-line values, so a bad ConfigMap entry fails with the flag's name.
    """
    return parser.parse_args(_with_env(parser, argv, environ))


def given_dests(parser: argparse.ArgumentParser, argv: list[str] | None,
                environ: dict[str, str] | None = None) -> set[str]:
    """The dests of single-value flags that ``argv`` or the environment set (as :func:`parse_with_env`
    reads them, abbreviations too): the rest hold their defaults, which a check may adjust where an
    explicit value would be an error. (Appending flags read the value before them: never listed.)"""
    unset = object()  # argparse sets a default only where the namespace has no such attribute
    single = (argparse._StoreAction, argparse._StoreConstAction, argparse.BooleanOptionalAction)
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if isinstance(a, single)})
    parser.parse_args(_with_env(parser, argv, environ), namespace)
    return {dest for dest, value in vars(namespace).items() if value is not unset}


def _with_env(parser: argparse.ArgumentParser, argv: list[str] | None, environ: dict[str, str] | None) -> list[str]:
    """``argv`` and, after it, each flag it does not give that the environment does."""
    environ = os.environ if environ is None else environ
    args = list(sys.argv[1:] if argv is None else argv)
    given = set(_options_in(args))
    env_args: list[str] = []
    for action in parser._actions:  # argparse has no public iterator over actions
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help" or any(o in given for o in action.option_strings):
            continue
        name = env_name(longs[0])
        if name not in environ and longs[0] in VLLM_ENV:
            name = VLLM_ENV[longs[0]]
        value = environ.get(name)
        if value is None:
            continue
        if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction (--x / --no-x)
            negative = next((o for o in longs if o.startswith("--no-")), None)
            if value.strip().lower() in ("1", "true", "yes", "on"):
                env_args.append(longs[0])
            elif value.strip().lower() in ("0", "false", "no", "off", ""):
                if negative is not None:
                    env_args.append(negative)
            else:
                parser.error(f"{name}: expected a boolean, got {value!r}")
        else:
            _check_env_value(parser, action, name, longs[0], value)
            env_args += [longs[0], value]
    return args + env_args


def _check_env_value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, flag: str,
                     value: str) -> None:
    """Convert and check ``value`` as argparse will, so that a bad one names its variable: argparse
    names only the flag, which a ConfigMap's reader may not find in the ConfigMap."""
    convert = parser._registry_get("type", action.type, action.type)  # (as argparse resolves type=)
    try:
        converted = convert(value) if callable(convert) else value
    except argparse.ArgumentTypeError as exc:
        detail = str(exc)
    except (TypeError, ValueError):
        detail = f"invalid {getattr(convert, '__name__', repr(convert))} value: {value!r}"
    else:
        if action.choices is None or converted in action.choices:
            return
        detail = f"invalid choice: {converted!r} (choose from {', '.join(map(repr, action.choices))})"
    parser.error(f"{name}: {detail}" if flag in detail else f"{name}: {flag}: {detail}")


def _options_in(argv: list[str]) -> list[str]:
    return [re.split("=", a, maxsplit=1)[0] for a in argv if a.startswith("-")]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"`` -> 2147483648; plain integers are bytes. For argparse ``type=``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a number with an optional unit (KiB, MiB, GiB, MB, GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def number(kind: type, name: str, low: float, low_inclusive: bool = False, high: float | None = None):
    """An argparse ``type=`` converting to ``kind`` within bounds, naming the flag when not."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else f"a {kind.__name__}"
            raise argparse.ArgumentTypeError(f"{name}: expected {expected}, got {text!r}") from None
        if value < low or (value == low and not low_inclusive) or (high is not None and value > high):
            bound = f"{'>=' if low_inclusive else '>'} {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{name}: must be {bound}, got {value}")
        return value
    return convert


def read_flag_file(path: str | os.PathLike, flag: str, max_bytes: int) -> bytes:
    """The bytes of the file a flag names; ValueError naming the flag when it cannot be read, is
    not a regular file (a FIFO or a device would block start-up or never end) or holds more than
    ``max_bytes``. One non-blocking open: what is checked is what is read."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        try:
            f = os.fdopen(fd, "rb")
        except OSError:
            os.close(fd)
            raise
        with f:
            info = os.fstat(f.fileno())
            data = f.read(max_bytes + 1) if stat.S_ISREG(info.st_mode) else b""
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {p}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or len(data) > max_bytes:
        raise ValueError(f"{flag}: {p} must be a regular file of at most {max_bytes} bytes")
    return data
