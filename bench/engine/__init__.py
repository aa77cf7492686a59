"""`blink bench offline`, `step`, `grain`, `tp`, `projections`: the engine measured in-process, no server."""
