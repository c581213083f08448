"""ampwatch."""
