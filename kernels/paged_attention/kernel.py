"""TODO(paged_attention): kernel."""
