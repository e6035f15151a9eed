"""The package's layers are one-way (docs/design.md, "Layers"), read from the source with ``ast`` (nothing imported):
no import circle among its modules, each module imports only its own layer and those below it, and an import inside a
function is only of an optional heavy dependency, with its reason on a comment."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = {"sage_compile": "sage_compile", "passes": "sage_compile.passes"}  # folder → the package it installs as

# Bottom → top; a module may import its own layer and the layers below. "pkg.*" is a package and every module in it.
# Mirrors docs/design.md's map: change both together.
LAYERS = [
    ("numerics", ["sage_compile.numerics.*"]),
    ("kernels", ["sage_compile.kernels.*", "sage_compile._C", "sage_compile._sm90", "sage_compile._sm89"]),
    ("policy", ["sage_compile.policy.*"]),
    ("ops", ["sage_compile.ops.*"]),
    ("passes", ["sage_compile.passes.*"]),
    ("backend", ["sage_compile.backend"]),
    ("surface", ["sage_compile", "sage_compile.api", "sage_compile.explanation", "sage_compile.calibration",
                 "sage_compile.distributed", "sage_compile.integrations.*", "sage_compile.demo_model",
                 "sage_compile.__main__", "sage_compile.bench.*"]),
]
EXTENSIONS = {"sage_compile._C", "sage_compile._sm90", "sage_compile._sm89"}  # built from csrc/, no .py source

# What an import inside a function may load: packages that are optional, and modules that import triton or a built
# extension at their top (absent from CPU builds of torch, or where the extension did not compile).
OPTIONAL_PACKAGES = {"triton", "transformers", "gguf", "tqdm"}
# torch's compiler (~1 s to import): where only compiling needs it, a module that eager calls import loads it late
COMPILER_MODULES = {"torch._inductor.config"}
OPTIONAL_MODULES = EXTENSIONS | {
    "sage_compile.kernels.triton", "sage_compile.kernels.prep_triton", "sage_compile.kernels.varlen_prep_triton",
    "sage_compile.kernels.backward.triton_bwd", "sage_compile.kernels.backward.prep_triton",
    "sage_compile.kernels.cpu", "sage_compile.kernels.sm90", "sage_compile.kernels.sm89",
    "sage_compile.kernels.backward.cpu",
}


def _modules():
    """module name → (path relative to the repository, whether it is a package's __init__)."""
    found = {}
    for folder, package in SOURCES.items():
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for file in sorted(files):
                if not file.endswith(".py"):
                    continue
                path = os.path.join(directory, file)
                parts = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                name = ".".join([package] + (parts[:-1] if is_package else parts))
                found[name] = (os.path.relpath(path, ROOT), is_package)
    return found


MODULES = _modules()


def layer_of(module):
    """The index in LAYERS of ``module``'s layer, or None where none names it."""
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if module == name or (name.endswith(".*") and (module == name[:-2] or module.startswith(name[:-1]))):
                return index
    return None


class _Import:
    def __init__(self, target, line, in_function):
        self.target, self.line, self.in_function = target, line, in_function


def _targets(module, is_package, node):
    """The modules an import statement loads: ``from pkg import name`` is pkg.name where that is a module, else pkg."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    known = set(MODULES) | EXTENSIONS
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]


def _imports(module):
    """Every import of ``module``, module level and inside functions."""
    path, is_package = MODULES[module]
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(_Import(t, child.lineno, in_function) for t in _targets(module, is_package, child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _package_imports(module):
    return [imp for imp in _imports(module) if imp.target == "sage_compile" or imp.target.startswith("sage_compile.")]


def test_every_module_is_in_a_layer():
    unassigned = [f"{name} ({path})" for name, (path, _) in sorted(MODULES.items()) if layer_of(name) is None]
    assert not unassigned, ("in no layer: " + ", ".join(unassigned) + ". Add each to LAYERS in tests/test_layers.py "
                            "and to the map in docs/design.md (\"Layers\").")


def test_imports_name_modules_that_exist():
    unknown = [f"{MODULES[m][0]}:{imp.line} imports {imp.target}" for m in MODULES for imp in _package_imports(m)
               if imp.target not in MODULES and imp.target not in EXTENSIONS and layer_of(imp.target) is None]
    assert not unknown, "imports of no known module: " + "; ".join(unknown)


def test_no_import_circle():
    graph = {m: sorted({imp.target for imp in _package_imports(m) if imp.target in MODULES}) for m in MODULES}
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in graph[module]:
            if state.get(target) == "open":
                circle = stack[stack.index(target):] + [target]
                pytest.fail("import circle: " + " → ".join(circle) + ". Move what one of them needs into a module "
                            "below both (docs/design.md, \"Layers\").")
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_each_module_imports_only_its_layer_and_those_below():
    upward = []
    for module in sorted(MODULES):
        own = layer_of(module)
        for imp in _package_imports(module):
            target = layer_of(imp.target)
            if own is not None and target is not None and target > own:
                upward.append(f"{MODULES[module][0]}:{imp.line}: {module} ({LAYERS[own][0]}) imports {imp.target} "
                              f"({LAYERS[target][0]})")
    assert not upward, ("imports up the layers — a layer may import only itself and the layers below it "
                        "(docs/design.md, \"Layers\"); move the code it needs down, or this code up:\n"
                        + "\n".join(upward))


def _optional(target):
    return target.split(".")[0] in OPTIONAL_PACKAGES or target in OPTIONAL_MODULES | COMPILER_MODULES


def _has_reason(lines, line):
    """A comment on the import's line, or on the line above the run of imports it starts or belongs to."""
    if "#" in lines[line - 1]:
        return True
    above = line - 2
    while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def test_imports_inside_functions_are_optional_dependencies_with_a_reason():
    problems = []
    for module in sorted(MODULES):
        path = MODULES[module][0]
        lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
        for imp in _imports(module):
            if not imp.in_function:
                continue
            if not _optional(imp.target):
                problems.append(f"{path}:{imp.line}: {imp.target} imported inside a function: import it at the top "
                                "(an inner import is only for triton, the built extensions and the modules that need "
                                "them, or an optional package: " + ", ".join(sorted(OPTIONAL_PACKAGES)) + ")")
            elif not _has_reason(lines, imp.line):
                problems.append(f"{path}:{imp.line}: {imp.target} imported inside a function without its reason: "
                                "say why on its line or the line above (e.g. `# triton: absent from CPU builds of "
                                "torch`)")
    assert not problems, "\n".join(problems)
