"""Which of the wheels in a folder a bare GPU machine must install (``gpu_check.sh``).

    python3 benchmarks/kernels/device_wheels.py .whl      prints one wheel path per line

A wheel is needed when its distribution is not installed, or is installed below the floor that
pyproject.toml sets for it (the device image's grpcio 1.84 under the stubs' 1.85.1). Wheels of
distributions the machine already has at a good version are left out, so that they do not shadow
the image's own (``pip install --target`` puts them first on the path). Standard library and
``packaging`` only: it runs before anything is installed.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def floors(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Requirement]:
    """Every requirement pyproject.toml states (dependencies and extras), by canonical name."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    out: dict[str, Requirement] = {}
    for text in reqs:
        r = Requirement(text)
        out.setdefault(canonicalize_name(r.name), r)
    return out


def installed(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def needed(wheels: list[Path], have=installed, reqs: dict[str, Requirement] | None = None) -> list[Path]:
    reqs = floors() if reqs is None else reqs
    out = []
    for wheel in sorted(wheels):
        name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        version = have(name)
        if version is None or (name in reqs and not reqs[name].specifier.contains(version, prereleases=True)):
            out.append(wheel)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    for wheel in needed(list(Path(argv[0]).glob("*.whl"))):
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
