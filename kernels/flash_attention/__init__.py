"""flash-attention-tpu: Pallas TPU flash attention (forward and backward) with a flash-attn 2
compatible torch API and a Transformers attention function."""

from . import _ops, integration, kernel, ops, reference, tiling
from .integration import attention_forward, register
from .ops import flash_attn_func, flash_attn_varlen_func
from .tiling import Tiles, choose_tiles, estimate_cost

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "attention_forward", "register",
           "Tiles", "choose_tiles", "estimate_cost", "kernel", "reference", "tiling", "ops",
           "integration"]
