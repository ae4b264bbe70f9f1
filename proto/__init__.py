"""pdserve.proto."""
