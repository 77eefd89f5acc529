"""A model path as a user gives it: a local file or folder, else a Hugging Face Hub id
(``org/name``) resolved by ``huggingface_hub`` to its snapshot folder, cached or downloaded.

Every loader that takes a model's path (checkpoints, ``config.json``, tokenizers) asks
:func:`local_path`, so a missing path is the same ``FileNotFoundError`` everywhere. It sits on
the runtime floor because ``NGramConfig.from_hf`` (``hashing/``) needs it too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

# A Hub repository id: ``org/name``, each part starting and ending with a letter or digit. A path
# of two parts naming a checkpoint or config file is a local path that is missing, not an id.
HUB_ID = re.compile(r"\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?")
FILE_SUFFIXES = (".safetensors", ".json")
# The files of a Hub model a tokenizer loader needs.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The values of HF_HUB_OFFLINE that mean "offline", as huggingface_hub reads them.
TRUE_VALUES = frozenset({"1", "on", "yes", "true"})


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for no network now (read at each call, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE_VALUES


def local_path(path: str | os.PathLike, what: str,
               patterns: Sequence[str] | None = None) -> str:
    """``path`` itself when it exists; else, for a ``str`` of the Hub's ``org/name`` form, the
    snapshot folder ``huggingface_hub`` resolves: its cache (``HF_HUB_CACHE``), or a download of
    the files matching ``patterns`` (default: all) unless ``HF_HUB_OFFLINE`` is set. Anything
    else is a FileNotFoundError naming ``what`` and ``path`` (and why the Hub did not answer)."""
    text = os.fspath(path)
    if os.path.exists(text):
        return text
    if not (isinstance(path, str) and HUB_ID.fullmatch(path)
            and not path.endswith(FILE_SUFFIXES)):
        raise FileNotFoundError(f"{what} not found: {text}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{what} not found: {text} is no local path, and huggingface_hub, which would look "
            "it up as a Hugging Face Hub id, is not installed (pip install huggingface_hub)"
        ) from None
    offline = hub_offline()
    try:
        return snapshot_download(path, cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                 allow_patterns=None if patterns is None else list(patterns),
                                 local_files_only=offline)
    except Exception as e:  # any failure of the look-up (network, cache, id) means: not found
        where = " in the cache (HF_HUB_OFFLINE is set)" if offline else ""
        raise FileNotFoundError(f"{what} not found: {text} is no local path, nor a Hugging Face "
                                f"Hub model huggingface_hub found{where}: {e}") from e
