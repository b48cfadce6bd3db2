"""Reads and validates the collection's root build.toml (schema documented in README.md)."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HUB_NAME_RE = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")  # the `kernels` library's KernelName rule
HUB_ORG_RE = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*[A-Za-z0-9]$")
KEY_RE = re.compile(r"^[a-z][a-z0-9_]*$")
KNOWN_BACKENDS = ("tpu", "cpu")
LICENSES = ("apache-2.0", "mit", "bsd-3-clause")

COLLECTION_KEYS = {"hub-org": str, "license": str, "source-url": str}
KERNEL_KEYS = {
    "hub-name": str,
    "source": str,
    "version": int,
    "backends": list,
    "description": str,
    "exports": list,
    "benchmark": str,
}
OPTIONAL_KERNEL_KEYS = {"benchmark"}
# Every kernel folder holds exactly these files (README "Adding a kernel").
KERNEL_FILES = ("__init__.py", "kernel.py", "reference.py", "tiling.py", "ops.py", "integration.py")


class ConfigError(ValueError):
    """A build.toml problem; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    key: str  # table name, e.g. "ragged_dot"
    hub_name: str  # e.g. "ragged-dot-tpu"
    source: Path  # absolute path of kernels/<key>
    version: int
    backends: tuple[str, ...]
    description: str
    exports: tuple[str, ...]
    benchmark: Path | None

    @property
    def python_name(self) -> str:
        return self.hub_name.replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Collection:
    path: Path
    root: Path
    hub_org: str
    license: str
    source_url: str
    kernels: tuple[KernelEntry, ...]

    def repo_id(self, kernel: KernelEntry) -> str:
        return f"{self.hub_org}/{kernel.hub_name}"

    def kernel(self, key_or_hub_name: str) -> KernelEntry:
        for k in self.kernels:
            if key_or_hub_name in (k.key, k.hub_name):
                return k
        raise KeyError(f"no kernel {key_or_hub_name!r} in {self.path}")


def _check_table(path: Path, where: str, table: dict, schema: dict, optional=frozenset()):
    for key in table:
        if key not in schema:
            raise ConfigError(f"{path}: unknown key '{where}.{key}' (allowed: {', '.join(schema)})")
    for key, typ in schema.items():
        if key not in table:
            if key in optional:
                continue
            raise ConfigError(f"{path}: missing key '{where}.{key}'")
        value = table[key]
        if typ is int and isinstance(value, bool) or not isinstance(value, typ):
            raise ConfigError(
                f"{path}: key '{where}.{key}' must be a {typ.__name__}, got {type(value).__name__}"
            )


def load_collection(path: Path | str | None = None) -> Collection:
    path = Path(path) if path is not None else ROOT / "build.toml"
    root = path.resolve().parent
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None

    for key in data:
        if key not in ("collection", "kernels"):
            raise ConfigError(f"{path}: unknown table '{key}' (allowed: collection, kernels)")
    if "collection" not in data:
        raise ConfigError(f"{path}: missing table 'collection'")
    coll = data["collection"]
    _check_table(path, "collection", coll, COLLECTION_KEYS)
    if not HUB_ORG_RE.match(coll["hub-org"]):
        raise ConfigError(
            f"{path}: key 'collection.hub-org' = {coll['hub-org']!r} is not a valid Hub org"
        )
    if coll["license"] not in LICENSES:
        raise ConfigError(f"{path}: key 'collection.license' must be one of {LICENSES}")

    tables = data.get("kernels")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path}: missing table 'kernels' (one [kernels.<name>] per kernel)")
    entries, hub_names = [], set()
    for key, table in tables.items():
        where = f"kernels.{key}"
        if not KEY_RE.match(key):
            raise ConfigError(f"{path}: table name '{where}' must be a lowercase identifier")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: '{where}' must be a table")
        _check_table(path, where, table, KERNEL_KEYS, OPTIONAL_KERNEL_KEYS)
        hub_name = table["hub-name"]
        if not HUB_NAME_RE.match(hub_name):
            raise ConfigError(
                f"{path}: key '{where}.hub-name' = {hub_name!r} must match {HUB_NAME_RE.pattern}"
            )
        if hub_name in hub_names:
            raise ConfigError(f"{path}: key '{where}.hub-name' = {hub_name!r} is used twice")
        hub_names.add(hub_name)
        source = (root / table["source"]).resolve()
        if source.parent != (root / "kernels").resolve() or not source.is_dir():
            raise ConfigError(
                f"{path}: key '{where}.source' = {table['source']!r} is not a folder under kernels/"
            )
        missing = [f for f in KERNEL_FILES if not (source / f).is_file()]
        if missing:
            raise ConfigError(
                f"{path}: key '{where}.source': {table['source']} lacks {', '.join(missing)}"
            )
        if table["version"] < 1:
            raise ConfigError(f"{path}: key '{where}.version' must be a positive integer")
        backends = table["backends"]
        bad = [b for b in backends if b not in KNOWN_BACKENDS]
        if bad or not backends or len(set(backends)) != len(backends):
            raise ConfigError(
                f"{path}: key '{where}.backends' = {backends!r}: expected distinct names from "
                f"{KNOWN_BACKENDS}"
            )
        exports = table["exports"]
        if not exports or not all(isinstance(e, str) and e.isidentifier() for e in exports):
            raise ConfigError(f"{path}: key '{where}.exports' must be a list of Python names")
        benchmark = None
        if "benchmark" in table:
            benchmark = (root / table["benchmark"]).resolve()
            if not benchmark.is_file() or not benchmark.name.startswith("benchmark"):
                raise ConfigError(
                    f"{path}: key '{where}.benchmark' = {table['benchmark']!r} is not a "
                    "benchmarks/benchmark*.py file"
                )
        entries.append(
            KernelEntry(
                key=key,
                hub_name=hub_name,
                source=source,
                version=table["version"],
                backends=tuple(backends),
                description=table["description"],
                exports=tuple(exports),
                benchmark=benchmark,
            )
        )
    return Collection(
        path=path,
        root=root,
        hub_org=coll["hub-org"],
        license=coll["license"],
        source_url=coll["source-url"],
        kernels=tuple(entries),
    )
