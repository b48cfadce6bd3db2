"""TODO(flash_attention): tiling."""
