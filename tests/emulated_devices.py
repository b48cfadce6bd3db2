"""Run a test file's case in a fresh process that sees several emulated CPU devices.

The pytest process has initialised JAX with one CPU device; `--xla_force_host_platform_device_count`
only takes effect before JAX starts, so multi-device cases re-run their own file as a script
(`python <file> <case>`) with the flag set, and report `CASE <name> OK` on success.
"""

from __future__ import annotations

import os
import subprocess
import sys


def run_case(script: str, name: str, devices: int = 8, timeout: int = 300) -> str:
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
    )
    r = subprocess.run(
        [sys.executable, script, name], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, f"case {name} failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    assert f"CASE {name} OK" in r.stdout, r.stdout[-4000:]
    return r.stdout
