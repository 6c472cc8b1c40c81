"""The package layout, found rather than listed (pyproject.toml holds everything else).

Four top-level folders are installed into one import namespace (docs/DESIGN.md §1). Every folder
under them is a package (data folders such as tools/arch_presets/ or server/static/ as namespace
packages), and every file in one that is not a module (kernel sources, presets, target
descriptions, static pages: whatever the code reads beside itself) ships as its data, so that a
new module or data file cannot be left out of a wheel.
"""

import pathlib

from setuptools import find_namespace_packages, setup

ROOT = pathlib.Path(__file__).parent
# import name -> folder (relative to this file)
NAMESPACE = {
    "jaxserve": "jaxserve",
    "jaxserve.models": "models",
    "jaxserve.server": "server",
    "jaxserve.pallas_kernels": "pallas_kernels",
}
# Never shipped as data: code (shipped as modules), build leftovers.
NOT_DATA = {".py", ".pyc", ".pyo", ".so", ".o"}


def _packages() -> dict[str, pathlib.Path]:
    """Every package's import name -> its folder."""
    found = {}
    for name, folder in NAMESPACE.items():
        found[name] = ROOT / folder
        for sub in find_namespace_packages(str(ROOT / folder), exclude=["*__pycache__*", ".*"]):
            if not any(part.startswith(".") for part in sub.split(".")):
                found[f"{name}.{sub}"] = ROOT / folder / sub.replace(".", "/")
    return found


def _data(folder: pathlib.Path) -> list[str]:
    """The files in `folder` that are not modules (its subfolders are packages of their own)."""
    return sorted(p.name for p in folder.iterdir()
                  if p.is_file() and p.suffix not in NOT_DATA and not p.name.startswith("."))


PACKAGES = _packages()
setup(
    packages=sorted(PACKAGES),
    package_dir=NAMESPACE,
    package_data={name: files for name, folder in PACKAGES.items() if (files := _data(folder))},
)
