from .support import dash, seed

__all__ = ["dash", "seed"]
