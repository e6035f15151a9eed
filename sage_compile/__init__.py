"""sage_compile: torch.compile runs attention as SageAttention-style 8-bit attention.

Importing this package changes no global state (no ops registered, no backend registered, no Inductor
config touched); ``torch.compile(model, backend="sage")`` finds the backend through its entry point.
"""
from .api import compile, sage_attention
from .config import SageConfig
from .explain import explain
from .sites import Site, SiteReport, UnsupportedAttentionError

__all__ = ["SageConfig", "compile", "sage_attention", "explain", "Site", "SiteReport",
           "UnsupportedAttentionError"]
__version__ = "0.1.0"
