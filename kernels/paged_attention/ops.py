"""TODO(paged_attention): ops."""
