"""What the tests share besides conftest's fixtures: builders, scripted servers, kernel inputs, checks."""
