"""Safetensors checkpoints as one name space over one or many files: read memory-mapped, written
atomically.

Data is read one row range at a time from the file's own layout (the ``safetensors`` NumPy loader
cannot build ``F8_E4M3`` tensors, and builds ``BF16`` only in some releases): an 8-byte
little-endian header length, a JSON header giving each tensor's dtype, shape and byte range, then
the raw bytes, viewed with the NumPy or ``ml_dtypes`` type. The same layout gives the zero-copy
``mmap`` views the ``mmap`` table placement serves rows from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ..formats import BY_SAFETENSORS
from ..runtime.atomic import atomic_file, remove_stale_temporaries
from ..runtime.model_paths import local_path

INDEX_FILE = "model.safetensors.index.json"
# The files of a Hub model a checkpoint loader needs: the tensors, their index and config.json.
CHECKPOINT_FILES = ("*.safetensors", "*.json")
# The __metadata__ key (in each file) and index metadata key naming a checkpoint's generation.
GENERATION_KEY = "ngram_cupy_generation"
# Reads of an index that a writer keeps replacing meanwhile, before giving up.
READ_ATTEMPTS = 3
_GENERATION_FILE = re.compile(r"^model-\d{5}-of-\d{5}(-[0-9a-f]{8})?\.safetensors$")

# Safetensors dtype codes and the NumPy (or ml_dtypes) types that hold them: the integer buffers
# and float64 here, UE8M0 block scales (MXFP8) as their bytes, the table formats from the format
# registry.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "F64": np.dtype(np.float64),
    "F8_E8M0": np.dtype(np.uint8),
    **{code: fmt.dtype for code, fmt in BY_SAFETENSORS.items()},
}

@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype code, shape and absolute byte range."""

    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _pread(fd: int, count: int, offset: int) -> bytes:
    """``count`` bytes at ``offset`` of an open file (fewer only at its end)."""
    chunks = []
    while count > 0:
        chunk = os.pread(fd, count, offset)
        if not chunk:
            break
        chunks.append(chunk)
        count, offset = count - len(chunk), offset + len(chunk)
    return b"".join(chunks)


def _header(fd: int, path: str) -> tuple[bytes, dict, int, int]:
    """The raw header bytes (length and JSON) of one open safetensors file, the JSON, where its
    data starts, and the file's size."""
    size = os.fstat(fd).st_size
    prefix = _pread(fd, 8, 0)
    length = int.from_bytes(prefix, "little")
    if size < 8 or length > size - 8:
        raise ValueError(f"{path} is not a safetensors file (bad header length)")
    raw = _pread(fd, length, 8)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (header is not a JSON object)")
    return prefix + raw, header, 8 + length, size


@contextlib.contextmanager
def _opened(path: str):
    """A read-only descriptor of ``path``, closed on leaving."""
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``__metadata__`` strings of one safetensors file (empty when it has none)."""
    path = os.fspath(path)
    with _opened(path) as fd:
        metadata = _header(fd, path)[1].get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ is not a JSON object")
    return metadata


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header alone (no tensor data is read)."""
    path = os.fspath(path)
    with _opened(path) as fd:
        return _tensor_infos(path, *_header(fd, path)[1:])


def _tensor_infos(path: str, header: dict, data_start: int, size: int) -> dict[str, TensorInfo]:
    """The checked tensor entries of one file's parsed header."""
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            well_formed = isinstance(dtype, str) and all(
                type(value) is int and value >= 0 for value in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            well_formed = False
        if not well_formed:
            raise ValueError(f"{path}: malformed header entry for tensor {name}")
        if dtype in DTYPES and end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
            raise ValueError(f"{path}: tensor {name} has {end - begin} bytes for shape {shape}")
        if not 0 <= begin <= end <= size - data_start:
            raise ValueError(f"{path}: tensor {name} lies outside the file (truncated?)")
        infos[name] = TensorInfo(name, path, dtype, shape, data_start + begin, data_start + end)
    spans = sorted((info.begin, info.end, name) for name, info in infos.items()
                   if info.end > info.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ValueError(f"{path}: tensors {first} and {second} overlap (data_offsets)")
    return infos


def checkpoint_paths(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The safetensors files of a checkpoint: a folder (its index json, else every
    ``*.safetensors`` in it), an index json, one file, a Hugging Face Hub id (its snapshot
    folder, see ``local_path``), or a list of files. A missing file is a FileNotFoundError
    naming it."""
    if isinstance(path, (str, os.PathLike)):
        path = Path(local_path(path, "checkpoint", CHECKPOINT_FILES))
        if path.is_dir():
            index = path / INDEX_FILE
            if index.is_file():
                return _indexed_paths(index)
            files = sorted(str(p) for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
            return files
        if path.name.endswith(".json"):
            return _indexed_paths(path)
        paths = [path]
    elif isinstance(path, Sequence):
        paths = [Path(p) for p in path]
        if not paths:
            raise ValueError("path is an empty list of checkpoint files")
    else:
        raise TypeError(f"path must be a path or a list of paths, got {type(path).__name__}")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint file(s) not found: {', '.join(missing)}")
    return [str(p) for p in paths]


def read_index(index: str | os.PathLike) -> tuple[dict[str, str], str | None]:
    """An index json's ``weight_map`` (tensor name -> file name) and the generation it names
    (None for an index not written by :func:`write_checkpoint`)."""
    index = Path(index)
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index} is not a safetensors index: {e}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"{index} is not a safetensors index: weight_map must map tensor names "
                         f"to file names, got {type(weight_map).__name__}")
    metadata = raw.get("metadata")
    generation = metadata.get(GENERATION_KEY) if isinstance(metadata, dict) else None
    return weight_map, None if generation is None else str(generation)


def _indexed_paths(index: Path) -> list[str]:
    """The files named by an index json's ``weight_map``, each once, in the order first named;
    for an index of :func:`write_checkpoint`, each must belong to the generation it names. An
    index replaced while it is read (a writer committing a new generation) is read again."""
    weight_map, generation = read_index(index)
    for attempt in range(READ_ATTEMPTS):
        try:
            return _generation_files(index, weight_map, generation)
        except (ValueError, FileNotFoundError):
            if generation is None or attempt == READ_ATTEMPTS - 1:
                raise
            weight_map, newer = read_index(index)
            if newer == generation:
                raise
            generation = newer


def _generation_files(index: Path, weight_map: dict[str, str],
                      generation: str | None) -> list[str]:
    """The files of ``weight_map``, each present and of ``generation`` (when it is not None)."""
    names = list(dict.fromkeys(weight_map.values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise FileNotFoundError(f"files named in {index} are missing: {', '.join(missing)}")
    paths = [str(index.parent / n) for n in names]
    if generation is not None:
        for path in paths:
            found = read_metadata(path).get(GENERATION_KEY)
            if found != generation:
                raise ValueError(
                    f"{path} belongs to checkpoint generation {found} but {index} names "
                    f"generation {generation}: the checkpoint is being rewritten, retry"
                )
    return paths


@dataclass(frozen=True)
class _OpenFile:
    """A checkpoint file held open since its header was read: rows are read and mapped through
    this descriptor, so a file replaced under the same name meanwhile is never mixed in."""

    fd: int
    stat: os.stat_result
    header: bytes  # the 8-byte length and the JSON header, as checked
    absolute: str  # the path, absolute: the working folder may change while the file is mapped


class Checkpoint:
    """The tensors of one or several safetensors files, by name; data is read only on demand.

    Each file stays open from the moment its header is read: every row comes from that same
    file, so a checkpoint replaced while it is read loads whole (the old one) or not at all.
    ``random_access=True`` advises the kernel (``madvise(MADV_RANDOM)``) that mapped views are
    read row by row, so a lookup does not pull in read-ahead it will never use.
    """

    def __init__(self, paths: Iterable[str | os.PathLike], random_access: bool = False):
        self.tensors: dict[str, TensorInfo] = {}
        self._files: dict[str, _OpenFile] = {}
        weakref.finalize(self, _close_all, self._files)
        for path in map(os.fspath, paths):
            fd = os.open(path, os.O_RDONLY)
            try:
                stat = os.fstat(fd)
                raw, header, data_start, size = _header(fd, path)
            except BaseException:
                os.close(fd)
                raise
            if path in self._files:
                os.close(fd)
                raise ValueError(f"{path} is named twice among the checkpoint's files")
            self._files[path] = _OpenFile(fd, stat, raw, os.path.abspath(path))
            for name, info in _tensor_infos(path, header, data_start, size).items():
                if name in self.tensors:
                    raise ValueError(
                        f"tensor {name} appears in both {self.tensors[name].path} and {path}"
                    )
                self.tensors[name] = info
        self.random_access = random_access
        self._mappings: dict[str, mmap.mmap] = {}

    @classmethod
    def open(cls, path, random_access: bool = False) -> Checkpoint:
        """A checkpoint from anything :func:`checkpoint_paths` accepts."""
        return cls(checkpoint_paths(path), random_access)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        """The tensor's file, dtype, shape and bytes; a ValueError naming it when absent."""
        try:
            return self.tensors[name]
        except KeyError:
            raise ValueError(f"the checkpoint has no tensor {name}") from None

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of a tensor (all of a 0-d one) as a NumPy array.

        Only those rows' bytes are read, from the file whose header located them, into a fresh
        array: nothing stays mapped, so loading a table shard by shard holds one shard at a time.
        """
        info = self.info(name)
        if info.dtype not in DTYPES:
            raise ValueError(f"tensor {name} has dtype {info.dtype}, which is not supported")
        dtype = DTYPES[info.dtype]
        rows, row_shape = (info.shape[0], info.shape[1:]) if info.shape else (1, ())
        stop = rows if stop is None else min(stop, rows)
        start = min(start, stop)
        row_bytes = math.prod(row_shape) * dtype.itemsize
        data = np.empty((stop - start) * row_bytes, dtype=np.uint8)
        offset, view = info.begin + start * row_bytes, memoryview(data)
        while view.nbytes:
            count = os.preadv(self._files[info.path].fd, [view], offset)
            if count == 0:
                raise ValueError(f"{info.path}: tensor {name} ends past the end of the file "
                                 "(truncated while reading?)")
            view, offset = view[count:], offset + count
        return data.view(dtype).reshape((stop - start, *row_shape) if info.shape else ())

    def view(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of a tensor in its mapped file."""
        info = self.info(name)
        if info.dtype not in DTYPES:
            raise ValueError(f"tensor {name} has dtype {info.dtype}, which is not supported")
        dtype = DTYPES[info.dtype]
        count = math.prod(info.shape)
        if count == 0:
            return np.empty(info.shape, dtype=dtype)
        mapping = self._mapping(info.path)
        return np.frombuffer(mapping, dtype=dtype, count=count, offset=info.begin).reshape(
            info.shape
        )

    def _mapping(self, path: str) -> mmap.mmap:
        """The read-only mapping of one file (of the descriptor its header was read through),
        made once and kept while views of it live."""
        if path not in self._mappings:
            mapping = mmap.mmap(self._files[path].fd, 0, access=mmap.ACCESS_READ)
            if self.random_access and hasattr(mapping, "madvise"):
                mapping.madvise(mmap.MADV_RANDOM)
            self._mappings[path] = mapping
        return self._mappings[path]

    def descriptor(self, path: str) -> int:
        """The descriptor a file of the checkpoint is held open through (``placement="disk"``
        reopens that inode for direct reads)."""
        return self._files[path].fd

    def check_mapped(self) -> None:
        """``check_files`` of the mapped files, for an mmap table."""
        self.check_files(self._mappings, "mmap")

    def check_files(self, paths: Iterable[str], kind: str = "disk") -> None:
        """Raise an ``OSError`` if one of these files changed since its header was read: shrunk
        (reading a page past its new end would kill a mapping process, SIGBUS), written in place
        (its header, size, modification time), or replaced or removed under its name (another
        inode there). An ``fstat``, a ``stat`` and a header read per file, cheap enough to run
        before every lookup of a ``kind`` table (a file changed during the lookup itself remains
        a race)."""
        for path in paths:
            held = self._files[path]
            now = os.fstat(held.fd)
            if now.st_size < held.stat.st_size:
                raise OSError(
                    errno.ESTALE,
                    f"{path} shrank from {held.stat.st_size} to {now.st_size} bytes since it "
                    f"was opened: the checkpoint was truncated under the {kind} table; load it "
                    "again",
                )
            if (now.st_size, now.st_mtime_ns) != (held.stat.st_size, held.stat.st_mtime_ns) \
                    or _pread(held.fd, len(held.header), 0) != held.header:
                raise OSError(errno.ESTALE, f"{path} was written to since it was opened (its "
                              f"size, header or modification time changed): the {kind} table's "
                              "rows are no longer the checkpoint's; load it again")
            try:
                named = os.stat(held.absolute)
            except FileNotFoundError:
                named = None
            if named is None or (named.st_dev, named.st_ino) != (now.st_dev, now.st_ino):
                how = "removed" if named is None else "replaced"
                raise OSError(errno.ESTALE, f"{path} was {how} since it was opened: the {kind} "
                              "table serves a checkpoint that is gone; load it again")


def _close_all(files: dict[str, _OpenFile]) -> None:
    """Close the descriptors a :class:`Checkpoint` holds."""
    for held in files.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    files.clear()


def write_checkpoint(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], num_files: int = 1, *,
    replaces: Collection[str] = (),
) -> list[str]:
    """Write tensors as safetensors, atomically; return the files written.

    ``path`` ending in ``.safetensors`` is one file, written to a temporary and renamed over it.
    Otherwise it is a folder that gets ``num_files`` files (tensors split in order, by count) and
    a ``model.safetensors.index.json``. Files take Hugging Face's names
    (``model-00001-of-00003.safetensors``). A folder checkpoint is replaced as a whole or not at
    all: the files of a new generation never take a name the live index names (where the standard
    names are taken, the generation is appended: ``model-00001-of-00003-<generation>``), carry the
    generation in their metadata, and become the checkpoint only when the index naming them
    replaces the old one, in one rename; then the previous generation's files are removed. Readers
    check that every file belongs to the index's generation, so none combines two. One writer per
    folder at a time; an index naming tensors not being written (another model's) is refused,
    except those named in ``replaces`` (the old tensors of a layer being rewritten).
    """
    if isinstance(num_files, bool) or not isinstance(num_files, int) or num_files < 1:
        raise ValueError(f"num_files must be a positive integer, got {num_files!r}")
    path = Path(path)
    names = list(tensors)
    if path.name.endswith(".safetensors"):
        if num_files != 1:
            raise ValueError(f"num_files={num_files} needs a folder path, got the file {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as temporary:
            _save(tensors, names, temporary, None)
        return [str(path)]
    path.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    previous = _previous_generation(path / INDEX_FILE, {*names, *replaces})
    generation = secrets.token_hex(4)
    num_files = min(num_files, max(1, len(names)))
    files = [path / f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    if previous & set(files):  # the standard names are the live checkpoint's: keep them whole
        files = [file.with_name(f"{file.stem}-{generation}.safetensors") for file in files]
    groups = {
        file: list(group) for file, group in
        zip(files, np.array_split(np.array(names, dtype=object), num_files), strict=True)
    }
    total = sum(np.asarray(a).nbytes for a in tensors.values())
    index = {
        "metadata": {"total_size": int(total), GENERATION_KEY: generation},
        "weight_map": {name: file.name for file, group in groups.items() for name in group},
    }
    written: list[Path] = []
    try:
        for file, group in groups.items():
            with atomic_file(file) as temporary:
                written.append(file)
                _save(tensors, group, temporary, generation)
        with atomic_file(path / INDEX_FILE) as temporary:
            Path(temporary).write_text(json.dumps(index, indent=2, sort_keys=True))
    except BaseException:
        for file in written:
            with contextlib.suppress(OSError):
                file.unlink()
        raise
    _remove_old_generations(path, previous, set(groups), {*names, *replaces})
    return [str(file) for file in groups]


def _save(tensors: Mapping[str, np.ndarray], names: list, file: str,
          generation: str | None) -> None:
    """One safetensors file of the named tensors (with the generation in its metadata)."""
    metadata = None if generation is None else {GENERATION_KEY: generation}
    save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, file, metadata=metadata)


def _previous_generation(index: Path, names: set[str]) -> set[Path]:
    """The files of the checkpoint being replaced; refuse to replace an index of other tensors
    than ``names``."""
    if not index.exists():
        return set()
    try:
        weight_map, _ = read_index(index)
    except ValueError:
        return set()  # an unreadable index names nothing we could remove
    foreign = sorted(set(weight_map) - names)
    if foreign:
        raise ValueError(
            f"{index} already names {len(foreign)} tensor(s) this checkpoint does not hold "
            f"(e.g. {foreign[0]}): write to a new folder rather than replace another model's "
            "index"
        )
    return {index.parent / name for name in weight_map.values()}


def _remove_old_generations(folder: Path, previous: set[Path], current: set[Path],
                            names: set[str]) -> None:
    """Delete the files of replaced generations: those the old index named and any left by an
    interrupted write, never one the new index names, and only files that hold nothing but
    tensors of this checkpoint or that :func:`write_checkpoint` wrote (they carry a generation)."""
    candidates = previous | {p for p in folder.iterdir() if _GENERATION_FILE.match(p.name)}
    for file in candidates - current:
        with contextlib.suppress(OSError, ValueError):
            if file.parent == folder and (GENERATION_KEY in read_metadata(file)
                                          or set(read_header(file)) <= names):
                file.unlink()
