"""blink.services."""
