"""`blink bench serve`, `prefix`, `overhead`, `startup`: Blink (or any OpenAI server) measured as clients see it."""
