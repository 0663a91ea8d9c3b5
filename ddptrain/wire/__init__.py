"""wire (docstring follows)."""
