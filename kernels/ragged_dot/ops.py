"""TODO(ragged_dot): ops."""
