"""TODO(ragged_dot): integration."""
