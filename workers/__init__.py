"""Ray actors that hold models."""
