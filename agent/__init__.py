"""ampwatch agent: attach to a mixed-precision training loop and stream its health signals."""
