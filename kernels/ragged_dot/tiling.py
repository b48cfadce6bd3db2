"""TODO(ragged_dot): tiling."""
