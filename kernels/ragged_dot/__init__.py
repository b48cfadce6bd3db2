"""TODO(ragged_dot): __init__."""
