"""TODO(flash_attention): integration."""
