"""`blink bench cpu`: CPU decode against its peers, transformers and llama.cpp."""
