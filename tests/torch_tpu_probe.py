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

# The built variant must load from its own files: the repository's module folders (this script's
# own, and those the dev venv's .pth adds, Makefile REPO_PATHS) leave the path first.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [
    p for p in sys.path if not (Path(p).parent == _ROOT and not Path(p).name.startswith("."))
]


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
    print(
        json.dumps(
            {
                "op_classes": op_classes,
                "outputs": [[list(o.shape), str(o.dtype), o.device.type] for o in outs],
            }
        )
    )


def _toy(mod):
    x = torch.empty(16, 128, device="meta", dtype=torch.bfloat16)
    return mod.scale_add(x, x, 2.0)


def _meta(shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="meta", dtype=dtype)


def _ragged_dot(mod):
    # Qwen3-30B-A3B gate_up shapes at 64 tokens (top-8): lhs [512, 2048], experts [128, 1536, 2048].
    lhs = _meta((512, 2048))
    rhs = _meta((128, 1536, 2048))
    group_sizes = _meta((128,), torch.int32)
    out = mod.gmm(lhs, rhs, group_sizes, transpose_rhs=True)
    grads = mod.tgmm(lhs, _meta((512, 1536)), group_sizes)
    return [out, grads]


def _flash_attention(mod):
    # Llama-3-8B heads at 2048 tokens, causal.
    q = _meta((1, 2048, 32, 128))
    kv = _meta((1, 2048, 8, 128))
    return mod.flash_attn_func(q, kv, kv, causal=True)


def _paged_attention(mod):
    # Llama-3-8B heads, 8 decode sequences over 64-token pages.
    seqs, pages_per_seq, page = 8, 16, 64
    q = _meta((seqs, 32, 128))
    cache = _meta((seqs * pages_per_seq, 16, page, 128))
    return mod.ragged_paged_attention(
        q,
        cache,
        _meta((seqs,), torch.int32),
        _meta((seqs, pages_per_seq), torch.int32),
        _meta((seqs + 1,), torch.int32),
        _meta((1,), torch.int32),
        validate=False,
    )


CASES = {
    "toy": _toy,
    "ragged_dot": _ragged_dot,
    "flash_attention": _flash_attention,
    "paged_attention": _paged_attention,
}

if __name__ == "__main__":
    main(*sys.argv[1:])
