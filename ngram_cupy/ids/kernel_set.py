"""Every GPU kernel the library launches, listed in one place, to build ahead into the kernel cache.

``ngram-cupy compile`` builds these for chosen architectures without a GPU. The Numba kernels
are specialised per model shape (a *scheme*: n-gram order, heads, head size, the table and
output formats) and per argument types; their variants come from running the library's own
launchers on tiny NumPy arrays with ``recorded_launches``, so the list cannot drift from what
the launchers pass. The CUDA C gather is one module with all its instances. A new kernel or
format is a new entry in ``VARIANTS`` (or a new scheme in ``SCHEMES``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import product

import numpy as np

from ..formats import BFLOAT16, FLOAT8_E4M3, FORMATS, default_output, find_format
from ..hashing.config import NGramConfig, read_hf_config
from ..hashing.engram_config import EngramConfig
from ..hashing.engram_layout import engram_layout
from ..hashing.layout import LayerLayout, layer_layout
from ..hashing.token_map import TokenMap
from ..runtime.cuda_launch import NumbaKernel, numba_type, recorded_launches
from ..tables import gather_cupy
from ..tables.hot_rows import build_map
from .engram_cuda import engram_params, launch_advance_lookback, launch_engram_ids
from .fused_cuda import launch_fused, word_bytes
from .ids_cuda import launch_advance_context, launch_ngram_ids, layout_params

# (tokens, query_start_loc, ngram_context) dtypes built ahead: all int64, and vLLM's int32
# token ids and request starts beside an int64 context.
INDEX_TYPES = ((np.int64, np.int64, np.int64), (np.int32, np.int32, np.int64))


@dataclass(frozen=True)
class Scheme:
    """A model shape whose Numba kernels are built ahead: its config (Qwen4Exp: layer 0's
    shape, which every layer shares; or an Engram config, all layers) and the (storage,
    output) format codes its fused lookups use."""

    name: str
    config: NGramConfig | EngramConfig
    formats: tuple[tuple[int, int], ...]

    @property
    def layout(self) -> LayerLayout:
        """Layer 0's layout (order, heads, head size)."""
        return layer_layout(self.config, 0)


RELEASED = NGramConfig(  # the released model's PLE configuration (docs/ids.md)
    vocab_size=248320, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
    eos_token_id=248044, embedding_dim=2560, make_ngram_vocab_size_divisible_by=512,
    split_ngram_parts=128, ple_embedding_dtype="float8_e4m3fn")
SCHEMES = {"released": Scheme("released", RELEASED, ((FLOAT8_E4M3, BFLOAT16),))}


def scheme_from_config(path: str) -> Scheme:
    """A scheme for a model config file: its shape, its table format (all formats when the
    config names none) read into that format's default output; an Engram config (its
    ``engram_*`` fields) gives the Engram kernels of its shape."""
    raw = read_hf_config(path)
    if "engram_layer_ids" in raw:
        return Scheme(path, EngramConfig.from_hf(raw), ())
    config = NGramConfig.from_hf(raw)
    if config.embedding_dim is None:
        raise ValueError(f"{path}: the config has no ple_embed_dim, so no table to build for")
    storage = [find_format(config.ple_embedding_dtype)] if config.ple_embedding_dtype \
        else list(FORMATS)
    if None in storage:
        raise ValueError(f"{path}: unknown ple_embedding_dtype {config.ple_embedding_dtype!r}")
    return Scheme(path, config, tuple((fmt.code, default_output(fmt).code) for fmt in storage))


@dataclass(frozen=True)
class Variant:
    """One kernel build: a name to show and filter by, and what builds it for one compute
    capability into the kernel cache."""

    name: str
    build: Callable[[tuple[int, int]], object]


def numba_variant(name: str, kernel: NumbaKernel, args: tuple) -> Variant:
    """A Numba kernel for the types of ``args``."""
    signature = tuple(numba_type(a) for a in args)
    return Variant(name, lambda cc: kernel.compiled(signature, cc))


def recorded(name: str, launcher: Callable[..., object], *args, **kwargs) -> list[Variant]:
    """The variants ``launcher(*args, **kwargs)`` (on NumPy arrays) would launch."""
    with recorded_launches() as launches:
        launcher(*args, **kwargs)
    return [numba_variant(name, kernel, args) for kernel, args in launches]


def ids_variants(scheme: Scheme) -> list[Variant]:
    """The ids and context-rolling kernels for each index type set."""
    if not isinstance(scheme.config, NGramConfig):
        return []
    layout = scheme.layout
    variants = []
    for types in INDEX_TYPES:
        tokens, starts, context = (np.zeros(shape, dtype) for shape, dtype in
                                   zip((1, 2, (1, layout.ngram_size - 1)), types, strict=True))
        tag = ",".join(np.dtype(t).name for t in types)
        ids = np.zeros((1, layout.num_heads), np.int64)
        variants += recorded(f"ids[{scheme.name} {tag}]", launch_ngram_ids, layout, tokens,
                             starts, context, layout_params(layout), ids)
        rolled = np.zeros_like(context, np.result_type(context, tokens))
        variants += recorded(f"advance_context[{tag}]", launch_advance_context, tokens, starts,
                             context, rolled)
    return variants


def fused_variants(scheme: Scheme) -> list[Variant]:
    """The fused ids + gather kernel, plain and tiered, per format pair and index type set."""
    if not isinstance(scheme.config, NGramConfig):
        return []
    layout = scheme.layout
    variants = []
    for (code, out_code), types, tiered in product(scheme.formats, INDEX_TYPES, (False, True)):
        fmt, out_fmt = FORMATS[code], FORMATS[out_code]
        tokens, starts, context = (np.zeros(shape, dtype) for shape, dtype in
                                   zip((1, 2, (1, layout.ngram_size - 1)), types, strict=True))
        row_bytes = fmt.row_width(layout.head_dim) * fmt.itemsize
        width = word_bytes(row_bytes, fmt.itemsize)
        table = np.zeros((1, row_bytes // width), np.dtype(f"u{width}"))
        scales = (np.zeros((1, fmt.scale_width(layout.head_dim)), np.uint8) if fmt.blocked
                  else None)
        out = np.zeros((1, layout.num_heads * layout.head_dim), out_fmt.raw)
        ids = np.zeros((1, layout.num_heads), np.int64)
        hot = counts = None
        if tiered:
            hot = (tuple(build_map(np.array([0]), 0, 1)), table)
            counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
        tag = (f"{scheme.name} {fmt.name}->{out_fmt.name} "
               f"{','.join(np.dtype(t).name for t in types)}{' tiered' if tiered else ''}")
        variants += recorded(f"fused[{tag}]", launch_fused, layout, tokens, starts, context,
                             layout_params(layout), table, code, 0, 1.0, True, ids, out,
                             out_code, hot=hot, counts=counts, scales=scales,
                             hot_scales=scales if tiered else None)
    return variants


def engram_variants(scheme: Scheme) -> list[Variant]:
    """The Engram ids (all layers) and lookback-rolling kernels of an Engram scheme's shape, for
    each index type set (the kernels depend on the shape, not on the tokenizer: a stand-in
    token map of the config's CV builds them)."""
    config = scheme.config
    if not isinstance(config, EngramConfig):
        return []
    size = config.engram_compressed_vocab_size
    stand_in = TokenMap(np.arange(size, dtype=np.int32), size, "kernel-set")
    layout = engram_layout(config, stand_in)
    width = layout.ngram_size - 1
    variants = []
    for types in INDEX_TYPES:
        tokens, starts = np.zeros(1, types[0]), np.zeros(2, types[1])
        positions = np.zeros(1, types[1])
        lookback = np.zeros((1, width), np.int64)
        dead, lookback_dead = np.zeros(1, np.uint8), np.zeros((1, width), np.uint8)
        out = np.zeros((1, layout.num_layers * layout.num_heads), np.int32)
        tag = ",".join(np.dtype(t).name for t in types[:2])
        variants += recorded(f"engram_ids[{scheme.name} {tag}]", launch_engram_ids, layout,
                             tokens, positions, starts, dead, lookback, lookback_dead,
                             layout.token_map, engram_params(layout), out)
        rolled = np.zeros((1, width), np.result_type(tokens, lookback))
        variants += recorded(f"advance_engram_lookback[{tag}]", launch_advance_lookback,
                             tokens, starts, lookback, rolled.dtype.type(-1), rolled)
    masks = np.zeros(1, np.bool_), np.zeros(2, np.int64), np.zeros((1, width), np.bool_)
    variants += recorded("advance_engram_lookback[dead mask]", launch_advance_lookback, *masks,
                         np.bool_(False), np.zeros((1, width), np.bool_))
    return variants


def gather_variants(scheme: Scheme | None = None) -> list[Variant]:
    """The CUDA C gather module (every instance; the same for every scheme)."""
    return [Variant("gather.cu", lambda cc: gather_cupy.module_build(f"sm_{cc[0]}{cc[1]}"))]


# The kernels the library launches, per kind: one entry per family of variants.
VARIANTS: tuple[Callable[[Scheme], list[Variant]], ...] = (
    gather_variants, ids_variants, fused_variants, engram_variants)


def kernel_variants(schemes: list[Scheme]) -> list[Variant]:
    """Every variant for ``schemes``, each once (by name), in ``VARIANTS`` order."""
    found: dict[str, Variant] = {}
    for family, scheme in product(VARIANTS, schemes):
        for variant in family(scheme):
            found.setdefault(variant.name, variant)
    return list(found.values())

