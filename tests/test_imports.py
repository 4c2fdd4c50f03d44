"""The package's import structure, read from the source with ``ast`` (nothing is imported).

The import graph has one node per module of ``shardplan`` (a package is its
``__init__.py``) and an edge ``A -> B`` for every import statement in ``A`` that
runs ``B`` or reads a name from it, wherever the statement stands: a function-local
import only postpones a cycle to call time, so it counts like a top-level one.

- ``import a.b.c`` is an edge to ``a.b.c``.
- ``from X import n`` is an edge to ``X.n`` when that is a module, and an edge to
  ``X`` unless ``n`` is a submodule and ``X`` is a package enclosing ``A``: Python
  has already started ``A``'s parent packages before ``A`` runs, so such a
  statement reads nothing from their ``__init__``.
- Parent packages are not implicit edges. Importing ``shardplan.planner.plan``
  runs ``shardplan/__init__.py`` first, but that is the import system's order,
  not a use of what the ``__init__`` re-exports; counting it would make every
  re-exporting ``__init__`` a cycle with each module it re-exports. A module that
  reads a name from an enclosing package's ``__init__`` gets the edge (rule above),
  so a real facade cycle is still found.
- ``DYNAMIC`` lists the packages whose ``__init__`` imports submodules by a
  computed name (``importlib.import_module``), as edges to every submodule.

No module reads a ``_private`` name from another module of the package (by
``from X import _n`` or ``X._n`` on an imported module), except a private
submodule from within its own package; ``PRIVATE_ALLOWED`` would list exceptions
with a reason.

Private torch (``torch._*``, a ``_``-prefixed torch submodule or name) is reached
only through ``shardplan/torch_compat.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import shardplan

ROOT = Path(shardplan.__file__).parent
COMPAT = "shardplan.torch_compat"

# package -> why its __init__ imports all its submodules by computed name
DYNAMIC = {"shardplan.planner.kinds": "each kind module registers itself when imported"}
# (importer, "module:name") -> reason; empty: no module reads another's private names
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module name ``node`` imports from."""
    if not node.level:
        return node.module
    package = importer if is_package(importer) else importer.rpartition(".")[0]
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def encloses(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def imports(name: str):
    """``(module, aliases, line)`` for each module an import statement of module ``name``
    names, anywhere in it; ``aliases`` are the ``from`` statement's, empty for ``import``."""
    for node in ast.walk(ast.parse(MODULES[name].read_text(), str(MODULES[name]))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield resolve(name, node), node.names, node.lineno


def edges(name: str):
    """The modules of ``shardplan`` that module ``name`` imports (the docstring's rule)."""
    for source, aliases, _ in imports(name):
        if source not in MODULES:
            continue
        if not aliases:
            yield source
        for n in (a.name for a in aliases):
            sub = f"{source}.{n}"
            if sub in MODULES:
                yield sub
            if sub not in MODULES or not encloses(source, name):
                yield source
    if name in DYNAMIC:
        yield from (m for m in MODULES if m.rpartition(".")[0] == name)


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    graph.add_edges_from((name, dep) for name in MODULES for dep in edges(name) if dep != name)
    return graph


def test_graph_sees_function_local_and_relative_imports():
    """The graph is read right: known edges of each kind are in it."""
    graph = import_graph()
    assert graph.has_edge("shardplan", "shardplan.api")              # from .api import
    assert graph.has_edge("shardplan.planner.plan", "shardplan.layouts")   # from ..layouts
    assert graph.has_edge("shardplan.planner.kinds", "shardplan.planner.kinds.reduce")
    assert graph.has_edge("shardplan.cli", "shardplan.generate_cli")  # inside main()
    assert not graph.has_edge("shardplan.planner.plan", "shardplan")  # parents: no edge


def test_no_import_cycles():
    cycles = [" -> ".join(c + [c[0]]) for c in nx.simple_cycles(import_graph())]
    print("\n".join(cycles))
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(cycles)


def bindings(name: str) -> dict[str, str]:
    """Local name -> the dotted module or object an import statement of ``name`` binds it to."""
    bound = {}
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            source = resolve(name, node)
            bound.update((a.asname or a.name, f"{source}.{a.name}")
                         for a in node.names if a.name != "*")
    return bound


def attribute_reads(name: str):
    """``(line, dotted)`` for each ``a.b.c`` read in module ``name`` whose last part is
    private and whose root is an imported name, ``dotted`` resolved through the import."""
    bound = bindings(name)
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        chain, inner = [], node
        while isinstance(inner, ast.Attribute):
            chain.insert(0, inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id in bound:
            yield node.lineno, ".".join([bound[inner.id]] + chain)


def owner(dotted: str) -> str | None:
    """The longest shardplan module ``dotted`` starts with."""
    parts = dotted.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                 if ".".join(parts[:i]) in MODULES), None)


def private_uses(name: str):
    """``"module:name"`` for each private name module ``name`` reads from another one."""
    for source, aliases, _ in imports(name):
        for n in (a.name for a in aliases if source in MODULES):
            if is_private(n) and not (f"{source}.{n}" in MODULES and encloses(source, name)):
                yield f"{source}:{n}"
    for _, dotted in attribute_reads(name):
        module = owner(dotted)
        if module and module != name:
            yield f"{module}:{dotted[len(module) + 1:]}"


def test_no_private_names_across_modules():
    found = [f"{name} reads {use}" for name in MODULES for use in private_uses(name)
             if (name, use) not in PRIVATE_ALLOWED]
    assert not found, "\n".join(found)


def torch_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(map(is_private, parts))


def private_torch_uses(name: str):
    """``"line: what"`` for each private torch module or name module ``name`` imports or reads."""
    for source, aliases, line in imports(name):
        for dotted in ([f"{source}.{a.name}" for a in aliases] if aliases else [source]):
            if torch_private(dotted):
                yield f"{line}: import {dotted}"
    for line, dotted in attribute_reads(name):
        if torch_private(dotted):
            yield f"{line}: {dotted}"


def test_private_torch_only_in_compat():
    found = [f"{MODULES[name].relative_to(ROOT.parent)}:{use}" for name in MODULES
             if name != COMPAT for use in private_torch_uses(name)]
    assert not found, "private torch outside torch_compat.py:\n" + "\n".join(found)
