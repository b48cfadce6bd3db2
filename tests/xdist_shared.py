"""Results computed once per test run and shared by every pytest-xdist worker."""

from __future__ import annotations

from pathlib import Path


def compute_once(config, name: str, compute):
    """`compute()`'s JSON-able result, computed by one pytest-xdist worker of this run and read by
    the others (a module-scoped fixture would otherwise run once per worker that takes one of its
    tests: twice the CPU on CI's two cores). Without xdist it just computes."""
    import fcntl
    import json
    import tempfile

    worker = getattr(config, "workerinput", None)
    if worker is None:
        return compute()
    folder = Path(tempfile.gettempdir()) / f"pallas-tests-{worker['testrunuid']}"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.json"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker computes; the others wait, then read
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(compute()))
            tmp.replace(path)
    return json.loads(path.read_text())
