"""Run in a subprocess with torch-tpu on PYTHONPATH (tests/test_torch_tpu_wrapper.py): loads a
built torch-tpu variant, checks its ops were registered through torch_tpu's `jax_op`, and calls
them on meta tensors (torch_tpu's fake exports the JAX function for TPU to get output shapes).

    python tests/torch_tpu_probe.py <variant folder> <case>

Prints one JSON line: {"op_classes": {...}, "outputs": [[shape, dtype], ...]}.
"""

import json
import sys
import types
from pathlib import Path

import torch

import torch_tpu  # noqa: F401  (autoloaded by torch already; explicit for clarity)


def main(variant: str, case: str):
    # kernels picks the torch-tpu variant only when torch.backends.tpu exists; on a CPU host
    # torch_tpu does not set it.
    if not hasattr(torch.backends, "tpu"):
        torch.backends.tpu = types.ModuleType("torch.backends.tpu")
    from kernels import get_local_kernel

    mod = get_local_kernel(Path(variant))
    namespace = mod._ops._OPS_NAME
    op_classes = {}
    for name in dir(mod.ops):
        obj = getattr(mod.ops, name)
        qualname = getattr(obj, "_qualname", None)
        if isinstance(qualname, str) and qualname.startswith(namespace + "::"):
            op_classes[qualname.split("::")[1]] = type(obj).__name__
    outputs = CASES[case](mod)
    outs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    print(json.dumps({
        "op_classes": op_classes,
        "outputs": [[list(o.shape), str(o.dtype), o.device.type] for o in outs],
    }))


def _toy(mod):
    x = torch.empty(16, 128, device="meta", dtype=torch.bfloat16)
    return mod.scale_add(x, x, 2.0)


CASES = {"toy": _toy}

if __name__ == "__main__":
    main(*sys.argv[1:])
