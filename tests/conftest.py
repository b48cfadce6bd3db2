import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
