"""The toy one-kernel collection in tests/toy_collection, built and loaded like a real kernel."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import build

TOY_ROOT = Path(__file__).resolve().parent / "toy_collection"
TOY_CONFIG = TOY_ROOT / "build.toml"


def copy_toy_collection(dest: Path) -> Path:
    """A private copy of the toy collection (tests edit its sources); returns its build.toml."""
    shutil.copytree(TOY_ROOT, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest / "build.toml"


def build_toy(out: Path, config: Path = TOY_CONFIG) -> Path:
    """Build the toy collection into `out`; returns the repo folder."""
    coll, results = build.build_all(out, config=config)
    return results[0][1]


@functools.cache
def load_toy():
    from kernels import get_local_kernel

    repo = build_toy(Path(tempfile.mkdtemp(prefix="ptk-toy-")))
    return get_local_kernel(repo / "build" / "torch-cpu", backend="cpu")
