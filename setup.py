"""The package layout, found rather than listed (pyproject.toml holds everything else).

Four top-level folders are installed into one import namespace (docs/DESIGN.md §1): every
package under each (a folder with an __init__.py) is found, and every other file in a package's
folder (kernel sources, presets, target descriptions, static pages: whatever the code reads
beside itself) ships with it, so that a new module or data file cannot be left out of a wheel.
"""

import pathlib

from setuptools import find_packages, setup

ROOT = pathlib.Path(__file__).parent
# import name -> folder (relative to this file)
NAMESPACE = {
    "jaxserve": "jaxserve",
    "jaxserve.models": "models",
    "jaxserve.server": "server",
    "jaxserve.pallas_kernels": "pallas_kernels",
}
# Never shipped as data: code (shipped as modules), build and editor leftovers.
NOT_DATA = {".py", ".pyc", ".pyo", ".so", ".o"}


def _packages() -> dict[str, pathlib.Path]:
    """Every package's import name -> its folder."""
    found = {}
    for name, folder in NAMESPACE.items():
        found[name] = ROOT / folder
        for sub in find_packages(str(ROOT / folder)):
            found[f"{name}.{sub}"] = ROOT / folder / sub.replace(".", "/")
    return found


def _data(folder: pathlib.Path, package_folders: set[pathlib.Path]) -> list[str]:
    """The data files of the package in `folder` (paths relative to it), its subpackages' left
    to them."""
    out = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or path.suffix in NOT_DATA:
            continue
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        if any(parent in package_folders for parent in path.parents if parent != folder
               and folder in parent.parents):
            continue  # belongs to a subpackage
        out.append(rel.as_posix())
    return out


PACKAGES = _packages()
FOLDERS = set(PACKAGES.values())
setup(
    packages=sorted(PACKAGES),
    package_dir={name: folder for name, folder in NAMESPACE.items()},
    package_data={name: files for name, folder in PACKAGES.items()
                  if (files := _data(folder, FOLDERS))},
)
