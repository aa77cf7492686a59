"""blink.shared."""
