"""`blink bench`: the serving benchmark (load generator, interference, energy, plots) and the engine's own."""
