"""agent (docstring follows)."""
