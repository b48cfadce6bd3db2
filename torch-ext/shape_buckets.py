"""Shape buckets: the few padded sizes every public op of this collection compiles for.

A compiled TPU kernel has static shapes, so every new row count, token count or batch size would
be a new compilation (seconds of Mosaic compile on TPU, more in interpret mode on CPU). The public
torch functions therefore pad the sizes that vary from call to call up to a bucket, run the kernel
at the bucket size, and cut the result back to the caller's size. Padding never changes a result:
padded rows join no group (ragged dot), padded tokens belong to no sequence and padded sequences
have no tokens and no keys (attention), padded outputs are never returned, and their gradients are
dropped by the same slicing. What varies inside a bucket (group sizes, sequence lengths, the
number of live sequences, cache lengths) travels as data in tensors, never as a compile key.

Two kinds of size are bucketed:

- Token counts ("tokens": rows = tokens x top-k of the grouped matmuls, packed query and key
  tokens of the varlen and paged attention functions, sequence lengths of dense attention). They
  are rounded up to `steps_per_octave` evenly spaced sizes per power of two, at least
  `min_tokens`, and always to a multiple of 8 (the TPU sublane tile). With the defaults (4 steps,
  floor 8) the buckets are 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, ..., 3584, 4096,
  ...: 32 sizes up to 4096, and a padded size is at most 25% (on average about 8%) above the real
  one once past the floor.
- Counts of sequences ("counts": the sequences of varlen, cache and paged attention, page-table
  rows and columns). They are rounded up to a power of two, at least `min_count` (default 1):
  1, 2, 4, 8, 16, 32, 64, ... A padded sequence does no attention (it has no tokens, or lies past
  the live `num_seqs`), but the paged kernels size their static work list by the sequence slots,
  so a coarser count floor costs idle grid steps on small batches
  (benchmarks/results/bucket_padding.md).

Setting the buckets. The policy in force is, in order: the innermost `use_bucket_policy(...)`
block, then the environment variable PALLAS_TPU_SHAPE_BUCKETS, then the defaults. The variable
holds "off" (no padding: one compilation per distinct shape, the behaviour before buckets) or
comma-separated settings, e.g. "steps=8,min_tokens=64,min_count=8". `set_bucket_policy(policy)`
writes that variable for the whole process; because this module is vendored into every package
of the collection (each package has its own copy), the environment variable is how one setting
reaches all of them: `set_bucket_policy` and `use_bucket_policy` both go through it.

Warming up a server: `token_buckets(max_tokens)` and `count_buckets(max_count)` list every bucket
up to a maximum; each package's `warmup(...)` function calls its ops once per bucket, so that
every kernel a server can need is compiled before the first request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Optional

__all__ = [
    "BUCKETS_ENV",
    "BucketPolicy",
    "bucket_policy",
    "set_bucket_policy",
    "use_bucket_policy",
    "bucket_tokens",
    "bucket_count",
    "token_buckets",
    "count_buckets",
]

BUCKETS_ENV = "PALLAS_TPU_SHAPE_BUCKETS"
# Token buckets are multiples of the TPU sublane tile.
TOKEN_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """How sizes are padded. `enabled=False` pads nothing (one compile per distinct shape)."""

    steps_per_octave: int = 4
    min_tokens: int = 8
    min_count: int = 1
    enabled: bool = True

    def __post_init__(self):
        for name in ("steps_per_octave", "min_tokens", "min_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BucketPolicy.{name}: expected a positive int, got {value!r}")
        if self.steps_per_octave & (self.steps_per_octave - 1):
            raise ValueError(
                f"BucketPolicy.steps_per_octave: expected a power of two (sizes "
                f"must nest across octaves), got {self.steps_per_octave}"
            )

    def tokens(self, n: int) -> int:
        """The token bucket of n (>= n)."""
        n = int(n)
        if not self.enabled:
            return n
        floor = _round_up(self.min_tokens, TOKEN_ALIGN)
        if n <= floor:
            return floor
        octave = 1 << (n - 1).bit_length() - 1  # largest power of two < n
        step = max(TOKEN_ALIGN, octave // self.steps_per_octave)
        return _round_up(n, step)

    def count(self, n: int) -> int:
        """The count bucket of n (>= n): a power of two, at least min_count."""
        n = int(n)
        if not self.enabled:
            return n
        return max(self.min_count, 1 << max(0, n - 1).bit_length())

    def to_env(self) -> str:
        if not self.enabled:
            return "off"
        return (
            f"steps={self.steps_per_octave},min_tokens={self.min_tokens},min_count={self.min_count}"
        )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


_KEYS = {
    "steps": "steps_per_octave",
    "steps_per_octave": "steps_per_octave",
    "min_tokens": "min_tokens",
    "min_count": "min_count",
}


_PARSED: dict = {}


def _parse(text: str) -> BucketPolicy:
    # A plain dict, not functools.lru_cache: torch.compile traces through this on every call.
    policy = _PARSED.get(text)
    if policy is None:
        policy = _PARSED[text] = _parse_uncached(text)
    return policy


def _parse_uncached(text: str) -> BucketPolicy:
    text = text.strip().lower()
    if text in ("", "on", "default"):
        return BucketPolicy()
    if text in ("off", "none", "0"):
        return BucketPolicy(enabled=False)
    settings = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ValueError(
                f"environment variable {BUCKETS_ENV}={text!r}: expected 'off' or comma-separated "
                f"key=value with keys {sorted(_KEYS)}"
            )
        try:
            settings[_KEYS[key]] = int(value)
        except ValueError:
            raise ValueError(
                f"environment variable {BUCKETS_ENV}: {key}={value!r} is not an integer"
            ) from None
    return BucketPolicy(**settings)


def bucket_policy() -> BucketPolicy:
    """The policy in force for this call (see the module docstring)."""
    return _parse(os.environ.get(BUCKETS_ENV, ""))


def set_bucket_policy(policy: Optional[BucketPolicy]) -> Optional[str]:
    """Set the process-wide policy (None: back to the defaults) for every package of the
    collection. Returns the previous value of the environment variable."""
    previous = os.environ.get(BUCKETS_ENV)
    if policy is None:
        os.environ.pop(BUCKETS_ENV, None)
    else:
        if not isinstance(policy, BucketPolicy):
            raise TypeError(f"policy: expected a BucketPolicy or None, got {type(policy).__name__}")
        os.environ[BUCKETS_ENV] = policy.to_env()
    return previous


@contextlib.contextmanager
def use_bucket_policy(policy: Optional[BucketPolicy] = None, **settings) -> Iterator[BucketPolicy]:
    """Run the block under `policy` (or the defaults with `settings` replaced, e.g.
    `use_bucket_policy(enabled=False)`), then restore the previous setting."""
    if policy is None:
        policy = dataclasses.replace(BucketPolicy(), **settings)
    elif settings:
        policy = dataclasses.replace(policy, **settings)
    previous = set_bucket_policy(policy)
    try:
        yield policy
    finally:
        if previous is None:
            os.environ.pop(BUCKETS_ENV, None)
        else:
            os.environ[BUCKETS_ENV] = previous


def bucket_tokens(n: int) -> int:
    """n tokens / rows padded to the current policy's token bucket."""
    return bucket_policy().tokens(n)


def bucket_count(n: int) -> int:
    """n sequences / batch rows / table columns padded to the current policy's count bucket."""
    return bucket_policy().count(n)


def token_buckets(max_tokens: int, min_tokens: int = 1) -> list[int]:
    """Every token bucket that a size in [min_tokens, max_tokens] can land in, ascending."""
    return _buckets(bucket_tokens, min_tokens, max_tokens)


def count_buckets(max_count: int, min_count: int = 1) -> list[int]:
    """Every count bucket that a count in [min_count, max_count] can land in, ascending."""
    return _buckets(bucket_count, min_count, max_count)


def _buckets(fn, lo: int, hi: int) -> list[int]:
    out = []
    n = max(1, int(lo))
    while n <= hi:
        b = fn(n)
        out.append(b)
        n = b + 1
    return out
