"""TODO(flash_attention): __init__."""
