"""pdserve.bench."""
