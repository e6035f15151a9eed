"""sage_compile: torch.compile runs attention as SageAttention-style 8-bit attention.

Importing this package changes no global state (no ops registered, no backend registered, no Inductor
config touched); ``torch.compile(model, backend="sage")`` finds the backend through its entry point.
"""
import os as _os

# passes/ and bench/ sit at the top of the repository and a wheel installs them as sage_compile.passes and
# sage_compile.bench (setup.py package_dir). Editable installs map top-level packages only, so a checkout finds
# them beside us.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "passes")) and _os.path.isfile(
        _os.path.join(_checkout, "passes", "__init__.py")):
    __path__.append(_checkout)

from .api import compile, merge_attention, sage_attention, sage_attention_varlen  # noqa: E402
from .config import SageConfig  # noqa: E402
from .explain import explain  # noqa: E402
from .plan import Plan, Target, calibrate, plan_step  # noqa: E402
from .scheme import Scheme  # noqa: E402
from .sites import Site, SiteReport, UnsupportedAttentionError  # noqa: E402

__all__ = ["SageConfig", "Scheme", "compile", "sage_attention", "sage_attention_varlen", "merge_attention", "explain",
           "calibrate", "plan_step", "Plan", "Target", "Site", "SiteReport", "UnsupportedAttentionError"]
__version__ = "0.1.0"
