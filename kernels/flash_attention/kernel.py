"""TODO(flash_attention): kernel."""
