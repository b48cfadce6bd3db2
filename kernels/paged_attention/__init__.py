"""TODO(paged_attention): __init__."""
