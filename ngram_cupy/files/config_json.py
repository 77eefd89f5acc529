"""A model folder's ``config.json``: read without replacing what cannot be read, merged and
written atomically; and the hash of a config's parameters that files of ids record."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..hashing.config import NGramConfig
from ..runtime.atomic import atomic_file


def existing_config(folder: str | os.PathLike) -> dict:
    """The JSON object of ``folder/config.json`` ({} when there is none); a ValueError naming
    the file when it is not one, rather than replacing a model's config it cannot read."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return {}
    try:
        existing = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} exists but is not readable JSON ({e}); fix or remove it") \
            from None
    if not isinstance(existing, dict):
        raise ValueError(f"{path} exists but holds a {type(existing).__name__}, not a JSON object")
    return existing


def write_config_json(folder: str | os.PathLike, config: NGramConfig) -> str:
    """Write ``config`` into ``folder/config.json`` (keys of a model's config already there are
    kept), atomically; return its path."""
    path = Path(folder) / "config.json"
    merged = {**existing_config(folder), **config.to_hf()}
    with atomic_file(path) as temporary:
        Path(temporary).write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    return str(path)


def config_hash(config: NGramConfig) -> str:
    """SHA-256 of the config's hash parameters (``to_hf`` as sorted JSON): files of ids made
    with the same hash carry the same value."""
    return hashlib.sha256(json.dumps(config.to_hf(), sort_keys=True).encode()).hexdigest()
