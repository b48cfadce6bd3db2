"""Load a kernel package of this collection the way users get it: built, then imported by `kernels`.

Tests never import kernels/<name> directly (its files use relative imports of the vendored bridge
and the generated _ops.py); they build the torch-cpu variant into a temporary folder and load it
with `kernels.get_local_kernel`, so every test also exercises the packaging.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import build
import collection

ROOT = Path(__file__).resolve().parent.parent

_BUILD_DIR = Path(tempfile.mkdtemp(prefix="ptk-test-build-"))


@functools.cache
def variant_path(key: str, backend: str = "cpu") -> Path:
    coll = collection.load_collection()
    entry = coll.kernel(key)
    dest = _BUILD_DIR / entry.hub_name / "build" / build.VARIANTS[backend]
    build.build_variant(coll, entry, backend, dest)
    return dest


@functools.cache
def load_kernel(key: str):
    """The built torch-cpu package of kernels/<key> (e.g. "ragged_dot"), as `get_kernel` returns it."""
    from kernels import get_local_kernel

    pkg = get_local_kernel(variant_path(key), backend="cpu")
    # `kernels` names a package by a hash of its files, so a second build of the same files (the
    # runner's repos, built_collection) loaded earlier in the session left its submodules in
    # sys.modules under this package's name: the new package module finds them there and never
    # binds them as attributes (pkg.schedule would be missing). Bind what is missing.
    prefix = pkg.__name__ + "."
    for name, module in list(sys.modules.items()):
        sub = name[len(prefix) :]
        if name.startswith(prefix) and "." not in sub and not hasattr(pkg, sub):
            setattr(pkg, sub, module)
    return pkg


@functools.cache
def built_collection() -> Path:
    """Every kernel built once per test session with scripts/build.py; returns the output folder
    (repos in <out>/<hub-name>, the offline Hub cache in <out>/hub-cache)."""
    out = _BUILD_DIR / "dist"
    build.build_all(out)
    return out


def hub_org() -> str:
    return collection.load_collection().hub_org


def repo_id(key: str) -> str:
    coll = collection.load_collection()
    return coll.repo_id(coll.kernel(key))


def use_offline_hub(monkeypatch) -> Path:
    """Point huggingface_hub / kernels at the build's offline cache, as after a real download with
    HF_HUB_OFFLINE=1 and HF_HUB_CACHE=<cache>. Returns the cache folder."""
    import huggingface_hub.constants as hf_constants

    cache = built_collection() / "hub-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache
