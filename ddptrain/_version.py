"""The package version, in a module of its own: the agent's version check reads it without
importing the public API (``ddptrain/__init__.py``)."""

__version__ = "0.1.0"
