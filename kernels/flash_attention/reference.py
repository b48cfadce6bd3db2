"""TODO(flash_attention): reference."""
