"""The Engram compressed token map (docs/engram.md): token id -> id of its normalised text.

Building it decodes every id of the tokenizer once (about a second for 129,280 ids), so the map
is cached on disk in the library's cache folder (``runtime.kernel_cache.cache_dir``), keyed by the
SHA-256 of the tokenizer's JSON, written atomically with a checksum that is checked on reading
(an edited or damaged entry is built again). The ``tokenizers`` package (the ``text``
extra) is needed to build it, not to read it back.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.atomic import atomic_file
from ..runtime.install_hint import install_hint
from ..runtime.kernel_cache import cache_dir
from ..runtime.model_paths import TOKENIZER_FILES, local_path

# Bumped whenever the normalisation or the entry changes, so no stale map is ever read back.
FORMAT_VERSION = 2
# A private-use character standing for a token that is exactly one space, so Strip keeps it.
SPACE_SENTINEL = "\ue000"
REPLACEMENT_CHARACTER = "\ufffd"


@dataclass(frozen=True, eq=False)
class TokenMap:
    """``ids[token]``: the compressed id (int32, read-only) of every tokenizer id; ``size``: CV,
    the number of compressed ids; ``digest``: SHA-256 of the tokenizer JSON it was built from."""

    ids: np.ndarray
    size: int
    digest: str

    @property
    def vocab_size(self) -> int:
        """Ids of the tokenizer (added tokens included)."""
        return int(self.ids.shape[0])

    def __repr__(self) -> str:
        return f"TokenMap(vocab_size={self.vocab_size}, size={self.size})"


def normalizer():
    """The normalisation of docs/engram.md as one ``tokenizers`` normalizer sequence."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(SPACE_SENTINEL, " "),
    ])


def token_key(text: str, raw_token: str | None, normalise) -> str:
    """The key a token's decoded ``text`` is numbered by: its raw token string when the text
    holds a partial UTF-8 byte (U+FFFD), else the normalised text (the text if that is empty)."""
    if REPLACEMENT_CHARACTER in text:
        return raw_token
    normalised = normalise(text)
    return normalised if normalised else text


def build_token_map(tokenizer) -> np.ndarray:
    """``int32 [vocab]`` compressed ids of a ``tokenizers.Tokenizer``: its keys numbered in
    first-seen order (every id decoded alone, special tokens kept)."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[token] for token in range(vocab)],
                                   skip_special_tokens=False)
    normalise = normalizer().normalize_str
    numbers: dict[str, int] = {}
    ids = np.empty(vocab, dtype=np.int32)
    for token, text in enumerate(texts):
        key = token_key(text, tokenizer.id_to_token(token), normalise)
        ids[token] = numbers.setdefault(key, len(numbers))
    return ids


def _tokenizer_class():
    """``tokenizers.Tokenizer``, or an error saying how to install it."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModuleNotFoundError(
            "engram_token_map needs the tokenizers package: " + install_hint("text")
        ) from None
    return Tokenizer


def _tokenizer_source(source: Any) -> tuple[str, Callable[[], Any]]:
    """``(sha256 of the tokenizer JSON, a function returning the tokenizers.Tokenizer)`` for a
    file, a folder or a tokenizer: a file is parsed only when its map is not cached."""
    if not isinstance(source, (str, os.PathLike)):
        backend = getattr(source, "backend_tokenizer", source)  # a transformers tokenizer
        if isinstance(backend, _tokenizer_class()):
            return hashlib.sha256(backend.to_str().encode()).hexdigest(), lambda: backend
        raise TypeError(f"tokenizer must be a tokenizer.json path, a folder holding one, or a "
                        f"tokenizers.Tokenizer, got {type(source).__name__}")
    path = local_path(source, "tokenizer", TOKENIZER_FILES)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"tokenizer: no such file: {file}")
    data = Path(file).read_bytes()

    def parse():
        tokenizer_class = _tokenizer_class()
        try:
            return tokenizer_class.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust library raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer {file!r} is not a valid tokenizer.json: {e}") from None

    return hashlib.sha256(data).hexdigest(), parse


def _is_first_seen_numbering(ids: np.ndarray) -> bool:
    """Whether ``ids`` numbers keys in first-seen order: each id at most one above all before."""
    if ids.ndim != 1 or ids.dtype != np.int32 or ids.size == 0 or ids[0] != 0:
        return False
    running = np.maximum.accumulate(ids)
    return bool(np.all(ids >= 0) and np.all(np.diff(running) <= 1))


def _checksum(ids: np.ndarray, digest: str) -> str:
    """SHA-256 of a map's int32 bytes and the tokenizer digest it was built from."""
    return hashlib.sha256(digest.encode() + np.ascontiguousarray(ids).tobytes()).hexdigest()


def _read_cached(path: Path, digest: str) -> np.ndarray | None:
    """A cached map whose checksum matches, or None when absent, unreadable or edited (it is
    then built again)."""
    try:
        with np.load(path, allow_pickle=False) as entry:
            ids, checksum = entry["ids"], str(entry["checksum"])
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None
    if not _is_first_seen_numbering(ids) or checksum != _checksum(ids, digest):
        return None
    return ids


def _write_cached(path: Path, ids: np.ndarray, digest: str) -> None:
    """Write the map and its checksum atomically; a cache that cannot be written is skipped,
    never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as temporary, open(temporary, "wb") as f:
            np.savez(f, ids=ids, checksum=np.array(_checksum(ids, digest)))
    except OSError:
        pass


_maps: dict[str, TokenMap] = {}
_maps_lock = threading.Lock()


def engram_token_map(tokenizer) -> TokenMap:
    """The compressed token map of a tokenizer (a ``tokenizer.json`` path, a folder holding
    one, a Hub id, or a ``tokenizers.Tokenizer``), from the disk cache when it holds it."""
    digest, parse = _tokenizer_source(tokenizer)
    with _maps_lock:
        if digest in _maps:
            return _maps[digest]
        path = cache_dir() / f"engram-token-map-v{FORMAT_VERSION}-{digest}.npz"
        ids = _read_cached(path, digest)
        if ids is None:
            ids = build_token_map(parse())
            _write_cached(path, ids, digest)
        ids.flags.writeable = False
        _maps[digest] = TokenMap(ids, int(ids.max()) + 1 if ids.size else 0, digest)
        return _maps[digest]
