"""What the benchmark compares: the kernels, the implementations of each (the JAX anchors and
ours) and the generations the headline columns use. The shapes themselves are in shapes.py, our
kernels' adapters in ours.py, the anchors' closed forms and calls in anchors.py.
"""

from __future__ import annotations

import anchors

KINDS = ("ragged_dot", "flash_attention", "paged_attention")
HEADLINE_GEN = "v6e"  # the generation whose tiling the headline bytes/steps columns show
SMALL_GEN = "v6e"
SMALL_GMM_TILING = (16, 128, 128)  # megablox tiling for the small shapes (rows must divide tm)

# -------------------------------------------------------------------------------------------------
# The anchors, described uniformly
# -------------------------------------------------------------------------------------------------


class Anchor:
    """One anchor configuration. `tiling(shape, small)` (ragged dot only) picks its tiles. An
    anchor whose configuration depends on the chip (`per_generation`) gets the generation as
    its functions' second argument instead (the headline generation where none is named), and
    `unsupported(shape, generation)` says why it cannot run a shape (None: it can). A
    `named_only` anchor has no rows in the small-shape section."""

    def __init__(
        self,
        kind,
        impl,
        label,
        cost,
        call,
        compile_args,
        interpretable,
        method,
        tiling=None,
        per_generation=False,
        named_only=False,
        unsupported=None,
    ):
        self.kind, self.impl, self.label, self._cost, self._call = kind, impl, label, cost, call
        self._compile_args, self.interpretable, self.method = compile_args, interpretable, method
        self._tiling, self.per_generation, self.named_only = tiling, per_generation, named_only
        self._unsupported = unsupported

    def _args(self, shape, small, generation=None):
        if self.per_generation:
            return (generation or HEADLINE_GEN,)
        return (self._tiling(shape, small),) if self._tiling else ()

    def cost(self, shape, small, generation=None):
        c, d = self._cost(shape, *self._args(shape, small, generation))
        info = {"notes": d.get("notes", [])}
        info.update({k: v for k, v in d.items() if k != "notes"})
        if self._tiling:
            t = self._tiling(shape, small)
            info["tiling"] = list(t) if isinstance(t, tuple) else t
        return c, info

    def call(self, shape, small, generation=None):
        return self._call(shape, *self._args(shape, small, generation))

    def compile_args(self, shape, generation=None):
        return self._compile_args(shape, *self._args(shape, False, generation))

    def unsupported(self, shape, generation=None) -> str | None:
        return self._unsupported(shape, generation or HEADLINE_GEN) if self._unsupported else None


_GMM_METHOD = (
    "closed form over its own make_group_metadata visit list (its traced grid does not "
    "interpret under jit; checked against the interpreter without the jit on small "
    "shapes)"
)
_RPA_METHOD = (
    "closed form from its schedule only: it does not run in TPU interpret mode (jax 0.10.2)"
)
ANCHORS = {
    "ragged_dot": [
        Anchor(
            "ragged_dot",
            "anchor:megablox_default",
            "jax megablox gmm (default 128^3 tiles)",
            anchors.gmm_cost,
            anchors.gmm_call,
            anchors.gmm_compile_args,
            True,
            _GMM_METHOD,
            tiling=lambda s, small: SMALL_GMM_TILING if small else anchors.GMM_TILING,
        ),
        Anchor(
            "ragged_dot",
            "anchor:megablox_large",
            "jax megablox gmm (128 x <=2048 x <=1024 tiles)",
            anchors.gmm_cost,
            anchors.gmm_call,
            anchors.gmm_compile_args,
            True,
            _GMM_METHOD,
            tiling=lambda s, small: (
                (SMALL_GMM_TILING[0], s.k, s.n) if small else anchors.gmm_large_tiling(s)
            ),
        ),
        Anchor(
            "ragged_dot",
            "anchor:megablox_tall",
            "jax megablox gmm (512 x <=1024 x <=1024 tiles)",
            anchors.gmm_cost,
            anchors.gmm_call,
            anchors.gmm_compile_args,
            True,
            _GMM_METHOD,
            tiling=lambda s, small: anchors.gmm_tall_tiling(s),
            named_only=True,  # the small shapes' 32 rows: the large tiles' row already
        ),
        Anchor(
            "ragged_dot",
            "anchor:tokamax_gmm",
            "tokamax gmm (its published best tiles, else its own default)",
            anchors.tokamax_gmm_cost,
            lambda s, g: anchors.tokamax_gmm_call(s, anchors.tokamax_gmm_config(s, g)),
            anchors.tokamax_gmm_compile_args,
            True,
            "tokamax 0.0.12's pallas_mosaic_tpu gmm (one pallas_call running emit_pipeline "
            "over megablox's grid and index maps); closed form over its own make_group_metadata "
            "visit list, checked against the TPU interpreter at a small shape "
            "(tests/test_benchmarks.py). Tiles per generation: "
            + "; else ".join(anchors.TOKAMAX_TILING_SOURCES.values()),
            per_generation=True,
            # its op refuses dimensions under 128: the small shapes have 32 rows
            named_only=True,
            unsupported=lambda s, g: anchors.tokamax_gmm_unsupported(
                s, anchors.tokamax_gmm_config(s, g)["tiling"]
            ),
        ),
    ],
    "flash_attention": [
        Anchor(
            "flash_attention",
            "anchor:flash_attention",
            "jax flash_attention (128 blocks)",
            anchors.flash_cost,
            anchors.flash_call,
            anchors.flash_compile_args,
            True,
            "closed form from its index maps (checked against the interpreter on small shapes)",
        ),
        Anchor(
            "flash_attention",
            "anchor:splash",
            "jax splash attention (512 blocks)",
            anchors.splash_cost,
            anchors.splash_call,
            anchors.splash_compile_args,
            True,
            "closed form from its own mask info (data_next / block_mask) and index maps, "
            "checked against the interpreter on small shapes (128 blocks there)",
            tiling=lambda s, small: 128 if small else anchors.SPLASH_BLOCK,
        ),
    ],
    "paged_attention": [
        Anchor(
            "paged_attention",
            "anchor:ragged_paged_attention",
            "jax ragged_paged_attention (its default / v6e-tuned blocks)",
            anchors.rpa_cost,
            anchors.rpa_call,
            anchors.rpa_compile_args,
            False,
            _RPA_METHOD,
        ),
        Anchor(
            "paged_attention",
            "anchor:ragged_paged_attention_fit",
            "jax ragged_paged_attention (KV blocks of <= 4 MiB)",
            anchors.rpa_cost,
            anchors.rpa_call,
            anchors.rpa_compile_args,
            False,
            _RPA_METHOD,
            tiling=lambda s, small: anchors.rpa_fit_pages(s),
        ),
    ],
}


def anchor(kind, impl) -> Anchor:
    return next(a for a in ANCHORS[kind] if a.impl == impl)


def impls(kind, named: bool = False) -> list[str]:
    """The row implementations of a kernel in the small-shape section (`named`: in the named
    section), in table order: its anchors, then ours."""
    return [a.impl for a in ANCHORS[kind] if named or not a.named_only] + ["ours"]


def problem_minimum(kind, shape):
    """The problem's own minimum bytes and useful FLOPs, the same for every implementation."""
    if kind == "ragged_dot":
        return anchors.gmm_min_bytes(shape), anchors.gmm_useful_flops(shape)
    if kind == "flash_attention":
        return anchors.attention_min_bytes(shape), anchors.attention_useful_flops(shape)
    return anchors.paged_min_bytes(shape), anchors.paged_useful_flops(shape)
