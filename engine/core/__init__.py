"""blink.engine.core: the step and what it is made of: per-slot state, admission, scheduling and its policies,
sampling, the commit, the KV page pool and its host mirror."""
