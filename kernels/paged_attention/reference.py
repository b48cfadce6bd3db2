"""TODO(paged_attention): reference."""
