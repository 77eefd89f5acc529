"""The package's floors (docs/design.md): every import of a ``ngram_cupy`` module, at module
level or inside a function, runs down the floors or within its own folder, and the imports form
no cycle (an import inside a function ties two modules as much as one at the top). Read from
the source with ``ast``, nothing imported."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "ngram_cupy"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
# Root modules that import nothing of the package: what the folders below share.
LEAVES = ("_version", "formats")
# Root modules below the files floor: the framework-free layer step every face drives, which the
# checkpoint loaders build.
LAYER = ("embedding",)
# What each area may import besides its own folder (leaves: not even each other). ``faces`` are
# the other root modules, which ``files`` may not import; ``package`` is
# ``ngram_cupy/__init__.py``, which no module imports (a module takes a name from the module that
# defines it).
BELOW_FILES = {"leaves", "runtime", "memory", "codecs", "hashing", "tables", "ids", "training"}
FLOORS = {
    "leaves": set(),
    "runtime": {"leaves"},
    "memory": {"leaves", "runtime"},
    "codecs": {"leaves", "runtime", "memory"},
    "hashing": {"leaves", "runtime"},
    "tables": {"leaves", "runtime", "memory", "codecs", "hashing"},
    "ids": {"leaves", "runtime", "memory", "codecs", "hashing", "tables"},
    "training": {"leaves", "runtime", "memory", "codecs", "tables"},
    "layer": {"leaves", "runtime", "memory", "codecs", "hashing", "tables", "ids"},
    "files": BELOW_FILES | {"layer"},
    "faces": BELOW_FILES | {"layer", "files", "faces", "torch"},
    "torch": BELOW_FILES | {"layer", "files", "faces"},
    "jax": BELOW_FILES | {"layer", "files", "faces"},
    "distributed": BELOW_FILES | {"layer", "files", "faces"},
    "cli": BELOW_FILES | {"layer", "files", "faces"},
    "package": BELOW_FILES | {"layer", "files", "faces", "torch", "distributed", "cli"},
}
# The upward imports issue 27 found, now gone: the floors must refuse each.
FIXED_UPWARD = (("ngram_cupy.runtime.backends", "ngram_cupy.tables.formats"),
                ("ngram_cupy.runtime.kernel_cache", "ngram_cupy.files.atomic"),
                ("ngram_cupy.hashing.token_map", "ngram_cupy.files.atomic"),
                ("ngram_cupy.arrow", "ngram_cupy"),
                # issue 50: files took Arrow column checks from the arrow face, which reads files
                ("ngram_cupy.files.engram_parquet", "ngram_cupy.arrow"))
# The import circles issue 50 found (function-level imports closing each), now gone: no cycle of
# the package may hold one again.
FIXED_CIRCLES = (("ngram_cupy.files.text_files", "ngram_cupy.files.token_files"),
                 ("ngram_cupy.training.reshard", "ngram_cupy.training.state_files"))


@dataclass(frozen=True)
class Import:
    """One import of a package module: who, what, where, and whether it runs at load time."""

    importer: str
    imported: str
    line: int
    at_load: bool  # outside any function: runs when the importer loads

    def __str__(self) -> str:
        when = "" if self.at_load else " (in a function)"
        return (f"{self.importer} (line {self.line}) imports {self.imported}{when}: "
                f"{area(self.importer)} may not import {area(self.imported)}")


def module_name(path: Path) -> str:
    """The dotted name of a source file of the package."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
FOLDERS = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def area(module: str) -> str:
    """The floor a module is on: its folder, a leaf, a face (root module) or the package."""
    parts = module.split(".")
    if parts in ([PACKAGE], [PACKAGE, "__main__"]):  # the package and ``python -m``
        return "package"
    if len(parts) == 2 and f"{PACKAGE}.{parts[1]}" not in FOLDERS:
        return "leaves" if parts[1] in LEAVES else "layer" if parts[1] in LAYER else "faces"
    return parts[1]



def allowed(importer: str, imported: str) -> bool:
    """Whether the floors let ``importer`` import ``imported``."""
    mine, theirs = area(importer), area(imported)
    if theirs == "package":
        return False
    return theirs in FLOORS[mine] or (mine == theirs and mine not in ("leaves", "faces"))


def imports_of(module: str, source: str, modules=MODULES) -> list[Import]:
    """Every import of a package module in ``source`` (the text of ``module``). ``from X import
    y`` imports module ``X.y`` when there is one, else a name of ``X``; relative imports resolve
    against the module's package."""
    is_package = modules.get(module, Path()).name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, at_load: bool) -> None:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules
                       else origin for alias in node.names]
        else:
            inner = at_load and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)
            return
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append(Import(module, target, node.lineno, at_load))

    visit(ast.parse(source), True)
    return found


IMPORTS = [found for module, path in MODULES.items()
           for found in imports_of(module, path.read_text(encoding="utf-8"))]


def test_the_parser_sees_the_package():
    """Every folder, module-level and function-level imports, and ``from . import`` of a
    module told from a name of the package."""
    assert {area(module) for module in MODULES} == set(FLOORS)
    assert any(found.at_load for found in IMPORTS)
    assert any(not found.at_load for found in IMPORTS)
    source = ("from . import arrow, __version__\nimport ngram_cupy.tables.table\n"
              "def late():\n    from .codecs import dequant\n")
    assert [(found.imported, found.at_load) for found in imports_of("ngram_cupy.stats", source)] \
        == [("ngram_cupy.arrow", True), ("ngram_cupy", True),
            ("ngram_cupy.tables.table", True), ("ngram_cupy.codecs.dequant", False)]


@pytest.mark.parametrize("importer, imported", FIXED_UPWARD)
def test_the_floors_refuse_the_upward_imports_that_were_fixed(importer, imported):
    assert not allowed(importer, imported)


def test_every_import_runs_down_the_floors():
    wrong = [str(found) for found in IMPORTS if not allowed(found.importer, found.imported)]
    assert not wrong, "imports up the floors:\n" + "\n".join(wrong)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(edges.get(module, ())):
            if other not in index:
                connect(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1 or module in edges.get(module, ()):
                groups.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            connect(module)
    return groups


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def import_edges() -> dict[str, set[str]]:
    """Who imports whom in the package, at load time or in a function."""
    edges: dict[str, set[str]] = {}
    for found in IMPORTS:
        if found.imported != found.importer:
            edges.setdefault(found.importer, set()).add(found.imported)
    return edges


def test_function_level_imports_close_cycles():
    """An import inside a function ties its module as much as one at the top."""
    source = {"ngram_cupy.a": "import ngram_cupy.b\n",
              "ngram_cupy.b": "def late():\n    from . import a\n"}
    modules = dict.fromkeys(source, Path("x.py"))
    edges = {module: {found.imported for found in imports_of(module, text, modules)}
             for module, text in source.items()}
    assert cycles(edges) == [["ngram_cupy.a", "ngram_cupy.b"]]


@pytest.mark.parametrize("circle", FIXED_CIRCLES)
def test_the_circles_that_were_fixed_stay_gone(circle):
    assert not [group for group in cycles(import_edges()) if set(circle) <= set(group)]


def test_no_import_cycles():
    found = cycles(import_edges())
    assert not found, "modules importing each other (function-level imports count):\n" + \
        "\n".join(" -> ".join(group) for group in found)
