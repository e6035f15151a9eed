"""sage_compile: torch.compile runs attention as SageAttention-style 8-bit attention.

Importing this package changes no global state (no ops registered, no backend registered, no Inductor
config touched); ``torch.compile(model, backend="sage")`` finds the backend through its entry point. The names
below are loaded on first use (PEP 562): ``sage_compile.sage_attention`` imports the user surface, whose modules
register the ops.
"""
import importlib as _importlib
import os as _os

# passes/ and bench/ sit at the top of the repository and a wheel installs them as sage_compile.passes and
# sage_compile.bench (setup.py package_dir). Editable installs map top-level packages only, so a checkout finds
# them beside us.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "passes")) and _os.path.isfile(
        _os.path.join(_checkout, "passes", "__init__.py")):
    __path__.append(_checkout)

# public name → the module that defines it (relative to this package)
_PUBLIC = {
    "SageConfig": ".policy.config",
    "Scheme": ".numerics.scheme",
    "compile": ".backend",
    "sage_attention": ".api",
    "sage_attention_varlen": ".api",
    "merge_attention": ".api",
    "explain": ".explanation",
    "calibrate": ".calibration",
    "plan_step": ".policy.plan",
    "Plan": ".policy.plan",
    "Target": ".policy.plan",
    "Site": ".policy.sites",
    "SiteReport": ".policy.sites",
    "UnsupportedAttentionError": ".policy.support",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
