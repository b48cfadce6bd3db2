"""TODO(paged_attention): tiling."""
