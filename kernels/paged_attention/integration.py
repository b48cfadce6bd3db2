"""TODO(paged_attention): integration."""
