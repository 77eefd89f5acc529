"""Compiled GPU kernels kept on disk, so that each is compiled once per machine, not per process.

An entry holds what loading a kernel needs (its PTX, its cubin or loadable image, the names of
its entry points), under a key hashing everything the machine code depends on: the kernel's
source text (a Numba kernel's Python module and every module of this package holding code it
calls, its closure constants; a CUDA C file with its headers), the argument types, the compute
capability, the compiler options and the compilers' versions. Entries live in
``NGRAM_CUPY_CACHE_DIR`` (default: ``$XDG_CACHE_HOME/ngram_cupy``, else ``~/.cache/ngram_cupy``),
one file each, written to a temporary and renamed into place (``runtime.atomic``): processes
filling the cache at once each write whole entries, and a reader sees an old entry, a new one,
or none. An entry that does not check out (truncated, edited, another format) is ignored and
rebuilt.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from functools import cache
from importlib import metadata
from pathlib import Path
from types import CodeType, ModuleType

from .atomic import atomic_file

CACHE_ENV = "NGRAM_CUPY_CACHE_DIR"
PACKAGE = __name__.split(".")[0]
MAGIC = b"ngram-cupy kernel cache 1\n"
SUFFIX = ".kernel"


def cache_dir() -> Path:
    """The cache folder: ``NGRAM_CUPY_CACHE_DIR``, else the user's cache folder (XDG)."""
    folder = os.environ.get(CACHE_ENV)
    if folder:
        return Path(folder).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ngram_cupy"


def entry_key(*parts) -> str:
    """The hex SHA-256 of the parts' ``repr`` (strings, numbers and tuples of them)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def code_names(code: CodeType) -> set[str]:
    """Every global and attribute name a code object reads, nested functions' included."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            names |= code_names(constant)
    return names


def in_package(value) -> bool:
    """Whether ``value`` (a module or a function) belongs to this package."""
    name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
    return isinstance(name, str) and name.split(".")[0] == PACKAGE


def kernel_modules(py_func: Callable) -> list[ModuleType]:
    """The modules of this package whose code a kernel compiles: the kernel's own, and that of
    every function of the package it calls, directly or through others (found by the names
    its code reads: globals, closure cells, and attributes of modules of the package)."""
    modules: dict[str, ModuleType] = {}
    seen: set[int] = set()
    pending = [py_func]
    while pending:
        function = pending.pop()
        function = getattr(function, "py_func", function)  # a Numba dispatcher's Python code
        code = getattr(function, "__code__", None)
        if code is None or id(function) in seen or not in_package(function):
            continue
        seen.add(id(function))
        modules[function.__module__] = sys.modules[function.__module__]
        scope = getattr(function, "__globals__", {})
        found = [scope[name] for name in code_names(code) if name in scope]
        found += [cell.cell_contents for cell in function.__closure__ or ()
                  if not isinstance(cell.cell_contents, (int, float, tuple, str))]
        for value in found:
            if isinstance(value, ModuleType) and in_package(value):
                modules[value.__name__] = value
                found += [getattr(value, name) for name in code_names(code)
                          if hasattr(value, name)]
            elif callable(value):
                pending.append(value)
    for module in list(modules.values()):  # constants Numba freezes in, imported from others
        modules.update((source.__name__, source) for source in constant_sources(module))
    return [modules[name] for name in sorted(modules)]


def constant_sources(module: ModuleType) -> list[ModuleType]:
    """The modules of this package ``module`` imports constants (not functions) from."""
    sources = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = module.__name__.rsplit(".", node.level)[0]
            name = f"{base}.{node.module}" if node.module else base
            if name in sys.modules and any(
                    not callable(getattr(module, alias.asname or alias.name, len))
                    for alias in node.names):
                sources.append(sys.modules[name])
    return sources


def constant_text(value) -> str:
    """A closure constant as text that is the same in every process (functions by name)."""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(constant_text, value)) + ")"
    return repr(value)


def function_digest(py_func: Callable) -> str:
    """A digest of what a Python kernel compiles from: its name, its closure constants and the
    source of every module of this package holding code it calls (``kernel_modules``)."""
    digest = hashlib.sha256(f"{py_func.__module__}.{py_func.__qualname__}".encode())
    for cell in py_func.__closure__ or ():
        digest.update(constant_text(cell.cell_contents).encode() + b"\0")
    for module in kernel_modules(py_func):
        digest.update(module.__name__.encode() + b"\0" + inspect.getsource(module).encode())
    return digest.hexdigest()


def _probe(read: Callable[[], object]) -> str:
    """One version as text, or ``none`` where the tool is missing."""
    try:
        return str(read())
    except Exception:  # a missing library is a version too: its entries differ
        return "none"


@cache
def numba_versions() -> tuple[str, ...]:
    """Versions Numba's PTX and its cubin depend on: Numba, numba-cuda, NVVM, nvJitLink."""
    def nvvm():
        from numba.cuda.cudadrv import nvvm

        return nvvm.NVVM().get_version()

    def nvjitlink():
        from cuda.bindings import nvjitlink

        return nvjitlink.version()

    return (_probe(lambda: metadata.version("numba")),
            _probe(lambda: metadata.version("numba-cuda")), _probe(nvvm), _probe(nvjitlink))


def encode_entry(fields: dict[str, str | bytes]) -> bytes:
    """An entry's bytes: the magic line, the SHA-256 of the body, the body (JSON; bytes in
    base64)."""
    body = json.dumps({name: {"bytes": base64.b64encode(value).decode()}
                       if isinstance(value, bytes) else value
                       for name, value in fields.items()}, sort_keys=True).encode()
    return MAGIC + hashlib.sha256(body).digest() + body


def decode_entry(data: bytes) -> dict[str, str | bytes] | None:
    """The fields of an entry, or None when it does not check out."""
    start = len(MAGIC) + 32
    if not data.startswith(MAGIC) or hashlib.sha256(data[start:]).digest() != data[len(MAGIC):
                                                                                    start]:
        return None
    try:
        body = json.loads(data[start:])
        return {name: base64.b64decode(value["bytes"]) if isinstance(value, dict) else value
                for name, value in body.items()}
    except (ValueError, TypeError, KeyError):
        return None


class NotCached(LookupError):
    """A kernel missing from the cache while only loads are allowed (``KernelCache.loads_only``)."""


class KernelCache:
    """Entries by key in one folder; counts the builds (compiles) and loads of this process."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.builds = 0
        self.loads = 0
        self.only_loads = False

    @contextlib.contextmanager
    def loads_only(self) -> Iterator[None]:
        """Inside the block a missing entry is ``NotCached`` instead of a compile (to learn
        cheaply which kernels still need compiling)."""
        self.only_loads = True
        try:
            yield
        finally:
            self.only_loads = False

    def path(self, key: str) -> Path:
        """Where the entry of ``key`` lives."""
        return (self.folder or cache_dir()) / f"{key}{SUFFIX}"

    def load(self, key: str) -> dict[str, str | bytes] | None:
        """The entry of ``key``, or None when there is none (or a broken one)."""
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        return decode_entry(data)

    def store(self, key: str, fields: dict[str, str | bytes]) -> None:
        """Write the entry of ``key`` atomically; a cache folder that cannot be written is
        skipped (the kernel still runs, compiled again by the next process)."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as temporary, open(temporary, "wb") as f:
                f.write(encode_entry(fields))
        except OSError:
            pass

    def fetch(self, key: str, build: Callable[[], dict[str, str | bytes]],
              check: Callable[[dict], bool] = lambda fields: True) -> dict[str, str | bytes]:
        """The entry of ``key``: loaded when present and ``check`` accepts it, else built (and
        stored)."""
        fields = self.load(key)
        if fields is not None and check(fields):
            self.loads += 1
            return fields
        if self.only_loads:
            raise NotCached(key)
        fields = build()
        self.builds += 1
        self.store(key, fields)
        return fields


KERNELS = KernelCache()  # the process's cache (folder read from the environment on each use)
