"""worker (docstring follows)."""
