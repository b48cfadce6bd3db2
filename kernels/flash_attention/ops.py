"""TODO(flash_attention): ops."""
