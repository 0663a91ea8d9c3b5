"""storage (docstring follows)."""
