"""driver (docstring follows)."""
