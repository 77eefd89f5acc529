"""Hugging Face transformers' Qwen4Exp models with ngram_cupy tables: :func:`use_ngram_cupy`
(and :func:`ngram_optimizers`, the row optimizers it attached).

transformers (>= 5.23) keeps each PLE table as an ``nn.Embedding`` in the model dtype. This
replaces every ``Qwen4ExpTextNGramEmbedding`` by :class:`CachedNGramEmbedding` (torch/cached.py):
the same call (``forward(input_ids[B, S], cache)`` giving ``[B, S, H * head_dim]`` in the model
dtype) and the same n-gram context in the cache, but the rows in an ``EmbeddingTable`` (float8,
bfloat16, ...; pinned host memory the GPU reads, GPU or CPU memory, or the mapped checkpoint)
read by this library's exact ids and gathers. Here: the checks, the tables (loaded or converted)
and the model surgery.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
import transformers

from .codecs.dequant import check_scale_rounding
from .codecs.quantize import quantize_table, quantize_target
from .embedding import NGramEmbedding
from .files.checkpoint import load_ngram_embedding
from .files.checkpoint_discovery import find_prefix
from .files.checkpoint_names import shard_key
from .files.checkpoint_reading import read_scale, verify_buffers
from .files.safetensors_files import DTYPES, Checkpoint
from .formats import QWEN4EXP, find_format, output_format, storage_format
from .hashing.config import NGramConfig
from .hashing.layout import LayerLayout, layer_layout, split_rows
from .tables.storage import RowsSource, place, placement_named
from .tables.table import EmbeddingTable
from .torch.autograd import fused_optimizer
from .torch.cached import CachedNGramEmbedding, one_cache
from .training.optimizers import OPTIMIZERS, RowOptimizer
from .transformers_releases import Qwen4ExpTextNGramEmbedding, check_layers, check_release

SINGLE_WEIGHT = "ngram_embedding.weight"
TABLE_OPTIONS = ("prefetch", "dedup", "progress", "scale_rounding")
PathLike = str | os.PathLike


def ngram_config(text_config) -> NGramConfig:
    """The library's config of a transformers ``Qwen4ExpTextConfig``: ``ple_layer_ids`` kept as
    transformers writes them (from 1), and a list of EOS ids gives its first, as transformers'
    layer takes it."""
    eos = text_config.eos_token_id
    return NGramConfig(
        vocab_size=text_config.vocab_size,
        ngram_size=text_config.ngram_size,
        heads_per_ngram=text_config.heads_per_ngram,
        ngram_vocab_size_base=text_config.ngram_vocab_size_base,
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        embedding_dim=text_config.ple_embed_dim,
        seed=text_config.seed,
        make_ngram_vocab_size_divisible_by=text_config.make_ngram_vocab_size_divisible_by,
        split_ngram_parts=text_config.split_ngram_parts,
        ple_layer_ids=tuple(text_config.ple_layer_ids),
        ple_embedding_dtype=getattr(text_config, "ple_embedding_dtype", None),
    )


def _prefetch_hook(target: CachedNGramEmbedding):
    """A forward pre-hook for the decoder layer before ``target``'s: starts its gather."""
    def hook(module, args, kwargs):
        input_ids = kwargs.get("ple_input_ids")
        if input_ids is None:
            return
        if target.prefetch is False or target.prefetch is None and not (
                input_ids.is_cuda and not target.table.storage.device_resident):
            return
        target.start_prefetch(input_ids, one_cache(kwargs.get("cache"),
                                                    kwargs.get("past_key_values")))
    return hook


def _named_dtype(config: NGramConfig) -> str | None:
    """The table dtype the model's config names (``ple_embedding_dtype``), canonical."""
    named = config.ple_embedding_dtype
    if named is None:
        return None
    fmt = find_format(named)
    return named.lower() if fmt is None else fmt.name


def _check_named(config: NGramConfig, dtype: str | None, what: str) -> None:
    """A table dtype the config does not name is refused (None: unknown here, left to the
    loader)."""
    named = _named_dtype(config)
    if named is not None and dtype is not None and dtype != named:
        raise ValueError(f"{what} is {dtype} but the model's config names "
                         f"ple_embedding_dtype={config.ple_embedding_dtype!r}")


def _checkpoint_dtype(checkpoint: Checkpoint, prefix: str) -> str | None:
    """The table's storage dtype name from the headers (None for one the registry lacks)."""
    name = f"{prefix}.{SINGLE_WEIGHT}"
    if name not in checkpoint:
        name = shard_key(prefix, 0)
    fmt = find_format(checkpoint.info(name).dtype)
    return None if fmt is None else fmt.name


def _load_single_weight(checkpoint: Checkpoint, prefix: str, layout: LayerLayout,
                        placement: str, hot_rows) -> NGramEmbedding:
    """A table saved as one ``P.ngram_embedding.weight``, copied in blocks of one checkpoint
    shard's rows (or served from the mapped file with ``placement="mmap"``)."""
    verify_buffers(checkpoint, prefix, layout)
    name = f"{prefix}.{SINGLE_WEIGHT}"
    info = checkpoint.info(name)
    fmt = find_format(info.dtype)
    if fmt is None or info.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {info.dtype}, which a single-weight table cannot be")
    shape = (layout.padded_rows, layout.head_dim)
    if info.shape != shape:
        raise ValueError(f"{name} has shape {info.shape} but the config's layout needs {shape}")
    scale = read_scale(checkpoint, prefix, fmt)
    parts = layout.config.split_ngram_parts

    def blocks():
        for index in range(parts):
            start, stop = split_rows(layout.padded_rows, parts, index)
            yield start, checkpoint.read(name, start, stop), None

    source = RowsSource(layout.padded_rows, layout.head_dim, fmt, blocks,
                        mapped=lambda: [(0, checkpoint.view(name))],
                        guard=checkpoint.check_mapped)
    return NGramEmbedding(layout, EmbeddingTable(place(placement, source), scale,
                                                 hot_rows=hot_rows))


def _from_model(module: Qwen4ExpTextNGramEmbedding, layout: LayerLayout, weight_dtype,
                placement: str, hot_rows) -> NGramEmbedding:
    """A table of the module's own rows in ``weight_dtype``, converted block by block."""
    weight = module.ngram_embedding.weight
    if weight.is_meta:
        raise ValueError("the model's n-gram tables are on the meta device: pass checkpoint=")
    fmt = storage_format(weight_dtype or weight.dtype, "weight_dtype")
    if fmt.encoder:  # quantised chunk by chunk (fp8, NVFP4) by its encoder, scales from the rows
        quantized = quantize_table(weight.detach(), quantize_target(fmt, QWEN4EXP))
        return NGramEmbedding(layout, EmbeddingTable(quantized, placement=placement,
                                                     hot_rows=hot_rows))
    parts = layout.config.split_ngram_parts

    def blocks():
        for index in range(parts):
            start, stop = split_rows(layout.padded_rows, parts, index)
            yield start, weight[start:stop].detach().to(fmt.torch_dtype), None

    source = RowsSource(layout.padded_rows, layout.head_dim, fmt, blocks)
    return NGramEmbedding(layout, EmbeddingTable(place(placement, source), hot_rows=hot_rows))


def _check_module(name: str, module: Qwen4ExpTextNGramEmbedding, layout: LayerLayout) -> None:
    """The model's own layer must be the one the config describes (its buffers, when real)."""
    shape = (layout.padded_rows, layout.head_dim)
    if tuple(module.ngram_embedding.weight.shape) != shape:
        raise ValueError(f"{name}.ngram_embedding.weight has shape "
                         f"{tuple(module.ngram_embedding.weight.shape)}, the config's layout "
                         f"{shape}")
    for buffer, want in (("layer_multipliers", layout.multipliers),
                         ("ngram_heads_vocab_sizes", layout.head_sizes),
                         ("ngram_heads_offsets", layout.head_offsets)):
        value = getattr(module, buffer)
        if not value.is_meta and value.tolist() != want.tolist():
            raise ValueError(f"{name}.{buffer} differs from the layout its config derives")


def _hot_rows_of(hot_rows, name: str, layer: int):
    """This layer's hot rows from ``hot_rows`` (keyed by module name or dense PLE layer)."""
    if hot_rows is None:
        return None
    return hot_rows.get(name, hot_rows.get(layer))


def _check_options(table_options: dict, hot_rows, names: Sequence[str], layers: Sequence[int]):
    """Refuse unknown table options and hot-row keys that name no replaced layer."""
    unknown = sorted(set(table_options) - set(TABLE_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected table option(s) {', '.join(unknown)}; use_ngram_cupy "
                        f"takes {', '.join(TABLE_OPTIONS)}")
    prefetch = table_options.get("prefetch")
    if prefetch is not None and not isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be True, False or None, got {prefetch!r}")
    if "scale_rounding" in table_options:
        check_scale_rounding(table_options["scale_rounding"])
    if hot_rows is None:
        return
    if not isinstance(hot_rows, Mapping):
        raise TypeError("hot_rows must map module names (or dense PLE layer indexes) to row "
                        f"ids, got {type(hot_rows).__name__}")
    stray = [key for key in hot_rows if key not in names and key not in layers]
    if stray:
        raise ValueError(f"hot_rows keys {stray} name no n-gram embedding of the model; its "
                         f"layers are {list(names)} (or {list(layers)})")


def use_ngram_cupy(model: torch.nn.Module, *, placement: str = "pinned",
                   checkpoint: PathLike | Sequence[PathLike] | None = None, weight_dtype=None,
                   hot_rows=None, trainable: bool = False, optimizer: str | None = None,
                   optimizer_options: Mapping | None = None, **table_options) -> list[str]:
    """Replace every ``Qwen4ExpTextNGramEmbedding`` of a transformers Qwen4Exp model by a
    :class:`CachedNGramEmbedding` holding this library's table; every check runs before any
    module is replaced.

    Args:
        model: any transformers ``Qwen4Exp*`` model (``torch.nn.Module``); its config's
            ``ple_layer_ids`` count decoder layers from 1, as transformers writes them.
        placement: ``"pinned"`` (default; page-locked host memory the GPU reads over PCIe;
            without a GPU, ordinary host memory), ``"gpu"``, ``"cpu"``, ``"shared"`` (one copy
            per node) or ``"mmap"`` (the checkpoint's mapped files; needs ``checkpoint``).
        checkpoint: a model folder, an index json, a file or a list of files holding the tables
            in the PLE checkpoint layout (shards) or as one ``ngram_embedding.weight``; rows are
            read shard by shard in their own dtype and never exist in the model dtype, so tables
            on the meta device work. Default None: the model's own rows.
        weight_dtype: the tables' storage type without ``checkpoint`` (float32, float16,
            bfloat16, float8_e4m3fn, ``"nvfp4"``, ``"mxfp8"``); default None: the config's
            ``ple_embedding_dtype``, else the model's dtype. ``"fp8"`` and ``"nvfp4"`` of a
            bf16 / float32 model quantise its rows (``quantize_table``, chunk by chunk).
        hot_rows: maps module names (or PLE layer indexes from 0) to sorted hot row ids;
            default None.
        trainable: ``True`` (float32 or bfloat16 tables in ``"pinned"``, ``"cpu"``, ``"gpu"``
            or ``"shared"``, whose segment every process updates: Hogwild): each table's weight
            is a parameter that backward gives a sparse gradient; default False.
        optimizer: with ``trainable``, ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``: that
            optimizer updates the rows inside the backward (no gradient is left on the
            weight); default None.
        optimizer_options: keyword arguments of that optimizer (``lr``, ...).
        **table_options: ``prefetch`` (True / False / None, the default: on for CUDA inputs
            with a host table), ``dedup`` (bool, default False: GPU lookups read each distinct
            row once), ``progress`` (a loading bar; None: on a terminal), ``scale_rounding``
            (``"output"``, vLLM 0.33's and the default, or ``"float32"``).

    Returns:
        The replaced module names, in model order
        (e.g. ``["model.layers.0.ple.ple_embedding", "model.layers.2.ple.ple_embedding"]``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_release(transformers.__version__)
    targets = _embeddings_of(model)
    if placement_named(placement, mapped=True).mapped and checkpoint is None:
        raise ValueError(f"placement {placement!r} serves a checkpoint's rows: pass checkpoint=")
    config = ngram_config(model.config.get_text_config())
    names = [name for name, _ in targets]
    layers = [module.ple_layer_index for _, module in targets]
    _check_options(table_options, hot_rows, names, layers)
    _check_training(trainable, optimizer, optimizer_options)
    asked = weight_dtype  # as the caller spelt it, for messages
    if weight_dtype is not None:
        fmt = storage_format(weight_dtype, "weight_dtype")
        _check_named(config, fmt.name, f"weight_dtype={weight_dtype}")
        weight_dtype = fmt.name  # NVFP4's torch dtype (uint8) would name no format
    layouts = _layouts(config, targets)
    prefixes = []
    if checkpoint is not None:
        opened = Checkpoint.open(checkpoint,
                                 random_access=placement_named(placement, mapped=True).mapped)
        prefixes = _checkpoint_prefixes(opened, names, layouts, weight_dtype, asked)
    elif weight_dtype is None and _named_dtype(config) is not None:
        weight_dtype = storage_format(config.ple_embedding_dtype).name
    embeddings = []
    for index, ((name, module), layout) in enumerate(zip(targets, layouts, strict=True)):
        rows = _hot_rows_of(hot_rows, name, layout.layer)
        if checkpoint is None:
            embeddings.append(_from_model(module, layout, weight_dtype, placement, rows))
            continue
        if f"{prefixes[index]}.{SINGLE_WEIGHT}" in opened:
            embeddings.append(_load_single_weight(opened, prefixes[index], layout, placement,
                                                  rows))
        else:
            embeddings.append(load_ngram_embedding(
                checkpoint, config, layout.layer, prefix=prefixes[index], placement=placement,
                progress=table_options.get("progress"), hot_rows=rows))
    _replace(model, targets, embeddings, table_options, trainable,
             (optimizer, optimizer_options))
    return names


def ngram_optimizers(model: torch.nn.Module) -> dict[str, RowOptimizer]:
    """The row optimizers ``use_ngram_cupy(model, trainable=True, optimizer=...)`` attached,
    by replaced module name, in model order (one per table): to ``synchronize()`` an
    asynchronous one, save its state (``state_dict``, ``save_training_state``) or set its
    ``lr``. Empty when none is attached (sparse gradients, or not trainable)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {name: module.trainable_rows.optimizer for name, module in model.named_modules()
            if isinstance(module, CachedNGramEmbedding) and module.trainable_rows is not None
            and module.trainable_rows.optimizer is not None}


def _embeddings_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's ``Qwen4ExpTextNGramEmbedding`` modules and their names, in model order; a
    ValueError for a model that has none, or whose were replaced already."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, Qwen4ExpTextNGramEmbedding)]
    done = [name for name, module in model.named_modules()
            if isinstance(module, CachedNGramEmbedding)]
    if done and not targets:
        raise ValueError(f"use_ngram_cupy was already applied to this {type(model).__name__} "
                         f"({done[0]} is ngram_cupy's): its layers are replaced once; to change "
                         "placement or weight_dtype, load the model again and call it once")
    if not targets:
        raise ValueError(f"{type(model).__name__} has no Qwen4ExpTextNGramEmbedding: "
                         "use_ngram_cupy replaces the n-gram embeddings of transformers' "
                         "Qwen4Exp models with PLE layers")
    check_layers(targets)
    return targets


def _layouts(config: NGramConfig, targets: list) -> list[LayerLayout]:
    """Each module's layer layout, checked against the module's buffers and dtype."""
    layouts = []
    for name, module in targets:
        layout = layer_layout(config, module.ple_layer_index)
        _check_module(name, module, layout)
        output_format(module.ngram_embedding.weight.dtype, f"{name} model dtype")
        layouts.append(layout)
    return layouts


def _checkpoint_prefixes(opened: Checkpoint, names: list[str], layouts: list[LayerLayout],
                         weight_dtype: str | None, asked) -> list[str]:
    """Each module's prefix in the checkpoint (its own name when the checkpoint uses it), its
    table's dtype checked against the config and ``weight_dtype`` (``asked``: as spelt)."""
    prefixes = []
    for name, layout in zip(names, layouts, strict=True):
        config = layout.config
        prefix = name if f"{name}.layer_multipliers" in opened else \
            find_prefix(opened.tensors, config, layout.layer)
        dtype = _checkpoint_dtype(opened, prefix)
        _check_named(config, dtype, f"the table of {prefix}")
        if weight_dtype is not None and dtype is not None \
                and dtype != storage_format(weight_dtype).name:
            raise ValueError(f"weight_dtype={asked} but {prefix} stores {dtype}: "
                             "checkpoint tables load in their own dtype")
        prefixes.append(prefix)
    return prefixes


def _replace(model: torch.nn.Module, targets: list, embeddings: list, table_options: Mapping,
             trainable: bool, optimizer: tuple) -> None:
    """Put a ``CachedNGramEmbedding`` over each embedding in its module's place (with the
    ``(name, options)`` optimizer, when named), and hook the layer before it for prefetch."""
    name_of_optimizer, optimizer_options = optimizer
    replacements = []
    for (_, module), embedding in zip(targets, embeddings, strict=True):
        embedding.table.dedup = bool(table_options.get("dedup", False))
        embedding.table.scale_rounding = table_options.get("scale_rounding", "output")
        replacements.append(CachedNGramEmbedding(embedding, module.layer_idx,
                                                 module.ngram_embedding.weight.dtype,
                                                 table_options.get("prefetch"), trainable))
        if name_of_optimizer is not None:
            fused_optimizer(replacements[-1], name_of_optimizer, **dict(optimizer_options))
    for (name, _), replacement in zip(targets, replacements, strict=True):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, replacement)
        _hook_previous_layer(model, name, replacement)


def _check_training(trainable: bool, optimizer, optimizer_options) -> None:
    """``optimizer`` needs ``trainable=True``, a known name and options with ``lr`` (whether a
    table trains is its own answer, asked once it is placed: ``check_trainable``)."""
    if not trainable:
        if optimizer is not None or optimizer_options is not None:
            raise ValueError("optimizer and optimizer_options need trainable=True")
        return
    if optimizer is None:
        if optimizer_options is not None:
            raise ValueError("optimizer_options need optimizer=")
        return
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if not isinstance(optimizer_options, Mapping) or "lr" not in optimizer_options:
        raise ValueError(f"optimizer={optimizer!r} needs optimizer_options with lr, e.g. "
                         "{'lr': 0.01}")


def _hook_previous_layer(model: torch.nn.Module, name: str,
                         target: CachedNGramEmbedding) -> None:
    """Prefetch from the decoder layer before the target's (``...layers.{i}.ple.ple_embedding``
    -> ``...layers.{i-1}``); nothing for the first layer or with ``prefetch=False``."""
    if target.prefetch is False or target.layer_idx == 0:
        return
    layers_name = name.rsplit(f".{target.layer_idx}.", 1)[0]
    previous = model.get_submodule(f"{layers_name}.{target.layer_idx - 1}")
    previous.register_forward_pre_hook(_prefetch_hook(target), with_kwargs=True)
