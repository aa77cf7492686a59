"""blink.ingress."""
