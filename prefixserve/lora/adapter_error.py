"""The error an adapter that cannot be served raises, from any of its formats (adapter.py, gguf_adapter.py)."""


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file or field and the fix."""
