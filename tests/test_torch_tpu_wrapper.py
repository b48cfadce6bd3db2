"""The TPU wrapper path (torch_tpu's `torch.tpu.pallas.jax_op`) as far as it goes without a TPU.

torch-tpu must never be imported in the test process (without libtpu and a TPU it kills the
process on `import torch`), so these tests run tests/torch_tpu_probe.py in a subprocess with the
separate .torch-tpu-env folder (made by `make setup`) on PYTHONPATH.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_loader
import toy_kernel

ROOT = Path(__file__).resolve().parent.parent
TORCH_TPU_ENV = Path(os.environ.get("TORCH_TPU_ENV", ROOT / ".torch-tpu-env"))


def probe(variant: Path, case: str) -> dict:
    if not (TORCH_TPU_ENV / "torch_tpu").is_dir():
        raise AssertionError(f"torch-tpu not found in {TORCH_TPU_ENV}: run `make setup`")
    env = dict(
        os.environ,
        PYTHONPATH=str(TORCH_TPU_ENV),
        JAX_PLATFORMS="cpu",
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        PYTHONWARNINGS="ignore",
    )
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "torch_tpu_probe.py"), str(variant), case],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_toy_kernel_registers_through_torch_tpu_and_exports_for_tpu(tmp_path):
    repo = toy_kernel.build_toy(tmp_path)
    result = probe(repo / "build" / "torch-tpu", "toy")
    assert result["op_classes"] == {"scale_add": "_JaxCustomOpDef"}
    assert result["outputs"] == [[[16, 128], "torch.bfloat16", "meta"]]


EXPECTED_OUTPUTS = {
    "ragged_dot": [
        [[512, 1536], "torch.bfloat16", "meta"],
        [[128, 2048, 1536], "torch.bfloat16", "meta"],
    ],
    "flash_attention": [[[1, 2048, 32, 128], "torch.bfloat16", "meta"]],
    "paged_attention": [[[8, 32, 128], "torch.bfloat16", "meta"]],
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("key", sorted(EXPECTED_OUTPUTS))
def test_kernel_registers_through_torch_tpu_and_exports_for_tpu(key):
    result = probe(kernel_loader.variant_path(key, backend="tpu"), key)
    assert result["op_classes"], f"{key}: no op registered in the package namespace"
    assert set(result["op_classes"].values()) == {"_JaxCustomOpDef"}, result["op_classes"]
    assert result["outputs"] == EXPECTED_OUTPUTS[key]
