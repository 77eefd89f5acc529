"""Which prefix holds which PLE layer among a checkpoint's tensor names."""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..hashing.config import NGramConfig

_PLE_KEY = re.compile(
    r"^(?P<prefix>.+)\.(?:layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets"
    r"|ngram_embedding\.(?:shard_\d+\.weight|weight_scale))$"
)
_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def ple_prefixes(names: Iterable[str]) -> list[str]:
    """Every PLE layer prefix among tensor names, in decoder layer order (the first number in
    the prefix), then by name."""
    found = {m["prefix"] for name in names if (m := _PLE_KEY.match(name))}
    return sorted(found, key=lambda p: (_decoder_layer(p) is None, _decoder_layer(p) or 0, p))


def _decoder_layer(prefix: str) -> int | None:
    """The first all-digit component of a prefix (``model.layers.7.ple...`` -> 7), or None."""
    match = _LAYER_NUMBER.search(prefix)
    return None if match is None else int(match.group(1))


def find_prefix(names: Iterable[str], config: NGramConfig, layer: int) -> str:
    """The prefix of dense PLE layer ``layer``: the prefix whose decoder module index is
    ``config.ple_layer_ids[layer] - 1`` when set (the ids count from 1, as transformers and vLLM
    write them; module names from 0), else the ``layer``-th PLE prefix in decoder order."""
    prefixes = ple_prefixes(names)
    if not prefixes:
        raise ValueError(
            "the checkpoint holds no PLE tensors (*.layer_multipliers, "
            "*.ngram_embedding.shard_N.weight); pass prefix= or check the path"
        )
    numbered: dict[int, list[str]] = {}
    for prefix in prefixes:
        if (number := _decoder_layer(prefix)) is not None:
            numbered.setdefault(number, []).append(prefix)
    if config.ple_layer_ids is not None:
        if layer >= len(config.ple_layer_ids):
            raise ValueError(f"layer {layer} is past ple_layer_ids {config.ple_layer_ids}")
        module = config.ple_layer_ids[layer] - 1
        wanted = (f"decoder module {module} (ple_layer_ids[{layer}] = "
                  f"{config.ple_layer_ids[layer]}, counted from 1)")
        candidates = numbered.get(module, [])
    elif len(prefixes) == 1:
        wanted, candidates = f"PLE layer {layer}", prefixes if layer == 0 else []
    else:
        order = sorted(numbered)
        wanted = f"the PLE layer at position {layer} in decoder order"
        candidates = numbered[order[layer]] if layer < len(order) else []
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(
        f"cannot tell which PLE prefix is {wanted}: "
        f"{'several match' if candidates else 'none matches'}; found {', '.join(prefixes)} "
        f"({len(prefixes)} PLE layer(s): layers 0 to {len(prefixes) - 1}). "
        "Pass prefix= explicitly"
    )
