"""decode_worker package."""
