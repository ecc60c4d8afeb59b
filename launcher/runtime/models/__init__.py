"""Model definitions the runtime can build from a recipe's shape (plain torch, no model hub)."""
from .llama import Llama, build_model

__all__ = ["Llama", "build_model"]
