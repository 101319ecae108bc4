from .support import dash, empty, seed

__all__ = ["dash", "empty", "seed"]
