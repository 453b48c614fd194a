"""benchmarks/kernels/device_wheels.py, run as gpu_check.sh runs it, on a simulated device image: a
bare GPU machine installs the wheels it lacks or has below pyproject.toml's floors, and keeps its
own packages otherwise (they would be shadowed: the wheels go first on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
LIST = ROOT / "benchmarks" / "kernels" / "device-wheels.txt"


def _dist(site: Path, name: str, version: str) -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _needed(tmp_path: Path, image: dict[str, str], wheels: list[str]) -> list[str]:
    site, folder = tmp_path / "site", tmp_path / "whl"
    folder.mkdir()
    for name, version in image.items():
        _dist(site, name, version)
    for w in wheels:
        (folder / w).write_bytes(b"")
    # The simulated image's distributions come first on the path, as the device's own site-packages.
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/kernels/device_wheels.py"), str(folder)],
                         capture_output=True, text=True, check=True, env=env)
    return [Path(line).name.split("-")[0] for line in out.stdout.split()]


def test_missing_and_too_old_distributions_are_installed_and_the_rest_kept(tmp_path):
    wheels = ["grpcio-1.85.3-cp312-cp312-manylinux_2_17_x86_64.whl", "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl",
              "zz_not_installed-1.0-py3-none-any.whl", "typing_extensions-4.16.0-py3-none-any.whl",
              "prometheus_client-0.26.0-py3-none-any.whl"]
    image = {"grpcio": "1.84.0", "pyzmq": "27.0.0", "typing_extensions": "4.12.2", "prometheus_client": "0.19.0"}
    # grpcio is below the stubs' floor (1.85.1) and zz_not_installed is missing; pyzmq and
    # prometheus_client meet pyproject's floors and typing_extensions has none of ours: they stay.
    assert _needed(tmp_path, image, wheels) == ["grpcio", "zz_not_installed"]


def test_every_listed_wheel_is_pinned_within_pyprojects_floor():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {}
    for text in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        r = Requirement(text)
        reqs.setdefault(r.name.lower().replace("_", "-"), r)
    pins = [ln.split("#")[0].strip() for ln in LIST.read_text().splitlines()]
    pins = [p for p in pins if p]
    assert pins and all("==" in p for p in pins)
    for pin in pins:
        name, version = pin.split("==")
        r = reqs.get(name.lower().replace("_", "-"))
        assert r is None or r.specifier.contains(version), f"{pin}: below pyproject's {r}"  # else installed, then refused
