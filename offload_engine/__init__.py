"""sequoia-offload: run a Llama-family model exactly, streaming its layers, with tree speculation."""

from .engine import Engine, GenerationResult
from .errors import UserError

__all__ = ["Engine", "GenerationResult", "UserError"]
__version__ = "0.1.0"
