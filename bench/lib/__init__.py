"""What the benchmarks share: datasets, load, backends, figures, plots, interference, energy, the machine, a server."""
