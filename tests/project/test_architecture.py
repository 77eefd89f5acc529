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
