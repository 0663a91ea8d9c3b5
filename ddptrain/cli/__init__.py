"""cli (docstring follows)."""
