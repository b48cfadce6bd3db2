"""TODO(ragged_dot): kernel."""
