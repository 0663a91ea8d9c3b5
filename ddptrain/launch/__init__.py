"""launch (docstring follows)."""
