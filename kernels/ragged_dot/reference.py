"""TODO(ragged_dot): reference."""
