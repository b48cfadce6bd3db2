import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU compiles each interpret-mode kernel (discharged into loops of small ops) to run it once
# on a few tiles; LLVM's optimisation passes were a quarter to a third of the slowest such tests
# (the dense flash sweep 31 -> 19 s). libtpu's deviceless compiles ignore both flags (the same
# LLO schedule, bundle for bundle, with and without them). Set before JAX starts a backend;
# subprocesses (emulated devices, benchmark programs) inherit them.
_CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_COMPILE_FLAGS}".strip()

from hypothesis import HealthCheck, settings  # noqa: E402

# "ci" keeps hypothesis sweeps bounded (CI runs them); "sweep" is the long form: HYPOTHESIS_PROFILE=sweep.
settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "sweep",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def tpu_interpret(monkeypatch):
    """Run torch ops of our kernels in TPU interpret mode (races, NaN memory, OOB reads raise)."""
    monkeypatch.setenv("PALLAS_TPU_INTERPRET", "tpu")
    yield
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
