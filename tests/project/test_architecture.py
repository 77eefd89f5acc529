"""The package's structural rules, checked on its source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ngram_cupy


def test_placements_are_asked_of_the_registry():
    """Placement names are compared only in the registry (``tables/storage/__init__.py``), and
    storage classes told apart only inside ``tables/storage/``: elsewhere code asks the registry
    (``placement_named``, ``place``) or a storage's abilities (``cold``, ``page_locked``, ...).
    Other comparisons with the same strings (a CLI's ``device == "gpu"``) are not placements."""
    package = Path(ngram_cupy.__file__).parent
    storages = package / "tables" / "storage"
    registry = storages / "__init__.py"

    def name_of(node: ast.AST) -> str:
        return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")

    def placement_named(node: ast.AST) -> bool:  # placement, self.placement, PLACEMENTS, ...
        return re.search(r"(^|_)placements?($|_)", name_of(node), re.IGNORECASE) is not None

    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and path != registry:
                by_value = any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                               for op in node.ops)
                operands = [node.left, *node.comparators]
                if by_value and any(map(placement_named, operands)):
                    found.append((str(where), node.lineno, ast.unparse(node)))
            elif (isinstance(node, ast.Call) and name_of(node.func) == "isinstance"
                  and len(node.args) == 2 and storages not in path.parents):
                kinds = node.args[1]
                kinds = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
                if any(name_of(kind).endswith("Storage") and name_of(kind) != "Storage"
                       for kind in kinds):
                    found.append((str(where), node.lineno, ast.unparse(node)))
    assert not found, ("placements chosen by name or storage class outside the registry "
                       "(ask tables.storage or the storage's abilities):\n"
                       + "\n".join(f"{path}:{line}: {code}" for path, line, code in sorted(found)))


# Where a format may be named: the registry, its codecs (``codecs/``: each format's decoders and
# encoders) and the compile-time kernels that freeze format codes in (Numba and CUDA C builds).
CODEC_FOLDERS = ("codecs/",)
CODEC_MODULES = {"formats.py", "ids/fused_cuda.py", "ids/kernel_set.py", "tables/gather_numba.py",
                 "training/updates_numba.py"}


def test_formats_are_asked_of_their_codec():
    """Outside the format registry and each format's decoders, code asks a format's entry
    (``Format``: what it stores, ``layer_names``, ``checkpoint_names(family)``, ``scaled``, ...)
    instead of naming a format: no format code constant (``NVFP4``, ``formats.FLOAT8_E4M3``), no
    entry taken by its number (``FORMATS[4]``) and no comparison with a format's name, or a
    collection of them (``fmt.name == "bfloat16"``, ``to in ("nvfp4", "mxfp8")``), not even held
    in a constant first (``TRAINABLE = ("float32", "bfloat16")``)."""
    package = Path(ngram_cupy.__file__).parent
    constants = {"FLOAT32", "FLOAT16", "BFLOAT16", "FLOAT8_E4M3", "NVFP4", "MXFP8"}
    names = {fmt.name for fmt in ngram_cupy.formats.FORMATS} | {"fp8", "e4m3", "nvfp4", "mxfp8"}

    def format_names(node: ast.AST) -> bool:  # "nvfp4", ("float32", "bfloat16"), ...
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(item, ast.Constant) and item.value in names for item in items)

    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where in CODEC_MODULES or where.startswith(CODEC_FOLDERS):
            continue
        tree = ast.parse(path.read_text(), str(path))
        held = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and format_names(node.value) for target in node.targets
                if isinstance(target, ast.Name)}  # constants holding format names
        for node in ast.walk(tree):
            named = (isinstance(node, ast.Name) and node.id in constants) or (
                isinstance(node, ast.alias) and node.name in constants) or (
                isinstance(node, ast.Attribute) and node.attr in constants)
            numbered = (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                        and node.value.id == "FORMATS" and isinstance(node.slice, ast.Constant))
            compared = isinstance(node, ast.Compare) and any(
                format_names(operand) or (isinstance(operand, ast.Name) and operand.id in held)
                for operand in (node.left, *node.comparators))
            if named or numbered or compared:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not found, ("formats named outside the registry and their decoders (ask the "
                       "format's entry in formats.py):\n" + "\n".join(found))


PACKAGE = Path(ngram_cupy.__file__).parent
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
# Kernel generators: one function whose closures Numba compiles with its constants frozen in (a
# helper outside would be another kernel's cache key).
LONG_FUNCTIONS = {"ids/fused_cuda.py:fused_kernel"}


def test_files_and_functions_are_short():
    """No module over 500 lines and no function (docstring included) over 80: one job each."""
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        source = path.read_text()
        if source.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{where}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{where}:{node.name}" not in LONG_FUNCTIONS:
                    long_functions.append(f"{where}:{node.lineno}: {node.name} ({lines} lines)")
    assert not long_files, f"modules over {MAX_FILE_LINES} lines:\n" + "\n".join(long_files)
    assert not long_functions, (f"functions over {MAX_FUNCTION_LINES} lines:\n"
                                + "\n".join(long_functions))


def test_quantize_finds_its_encoder_through_the_registry():
    """No ``fmt.code == ...`` outside the registry, the codecs and the compile-time kernels, and
    no second table of quantised format names: the registry's entries name their encoders."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "FORMAT_OF":
                found.append(f"{where}:{node.lineno}: FORMAT_OF")
            if where in CODEC_MODULES or where.startswith(CODEC_FOLDERS):
                continue
            if isinstance(node, ast.Compare) and any(
                    isinstance(operand, ast.Attribute) and operand.attr == "code"
                    and not all(isinstance(other, ast.Attribute) and other.attr == "code"
                                for other in (node.left, *node.comparators))
                    for operand in (node.left, *node.comparators)):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "formats dispatched on outside their codecs:\n" + "\n".join(found)


def test_one_trainability_rule():
    """Whether a table trains is asked of ``training.table_rows`` (its format, whether it is
    closed, and its storage's own ``training_refusal``) by the core and both torch faces alike:
    no other module defines a trainability check or reads the trainable formats, and none asks
    a placement (``private``) instead of the table."""
    rule = "training/table_rows.py"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == rule:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            defined = (isinstance(node, ast.FunctionDef) and node.name == "check_trainable")
            named = isinstance(node, ast.Name) and node.id in ("TRAINABLE", "TRAINABLE_NAMES")
            private = (isinstance(node, ast.Attribute) and node.attr == "private"
                       and not where.startswith("tables/storage/"))
            if defined or named or private:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    assert not found, f"trainability decided outside {rule}:\n" + "\n".join(found)


def test_block_scale_branches_live_in_the_codecs():
    """"Does it carry block scales" is a codec's question: outside the registry, ``codecs/``
    and the storages, at most 10 places branch on ``.blocked``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "formats.py" or where.startswith(("codecs/", "tables/storage/")):
            continue
        found += [f"{where}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Attribute) and node.attr == "blocked"]
    assert len(found) <= 10, "branches on .blocked outside the codecs:\n" + "\n".join(found)


def test_one_handle_registry():
    """Live objects behind integer keys are kept in one place, ``runtime/handles.py``, which the
    registered torch ops and the XLA custom calls both resolve through: no other module keeps a
    ``WeakValueDictionary``, a module-level dict from ``int`` to weak references, or its own
    ``register`` / ``resolve``; both bridges import the registry."""
    registry = "runtime/handles.py"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == registry:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            weak_values = (isinstance(node, ast.Name) and node.id == "WeakValueDictionary"
                           or isinstance(node, ast.Attribute)
                           and node.attr == "WeakValueDictionary")
            defined = isinstance(node, ast.FunctionDef) and node.name in ("register", "resolve")
            if weak_values or defined:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
        for node in tree.body:  # module-level ``name: dict[int, ... weakref ...]``
            annotation = ast.unparse(getattr(node, "annotation", None) or ast.Pass())
            if annotation.startswith(("dict[int,", "OrderedDict[int,")) and "weakref" in annotation:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    assert not found, f"live objects kept by key outside {registry}:\n" + "\n".join(found)
    for bridge in ("torch/ops.py", "jax/ffi.py"):
        assert re.search(r"from \.\.runtime(\.handles)? import (handles|resolve)",
                         (PACKAGE / bridge).read_text()), f"{bridge} does not use {registry}"
