"""``ngram-cupy quantize``: a model's float n-gram tables quantised into a new checkpoint in the
engines' own names, written into a temporary folder renamed onto OUTPUT when complete.

Qwen4Exp (vLLM's names): per PLE layer ``P.ngram_embedding.shard_{i}.weight`` (F8_E4M3 with the
scalar F32 ``P.ngram_embedding.weight_scale``; or NVFP4's packed U8 with F8_E4M3
``shard_{i}.weight_scale`` and the F32 ``weight_scale_2``), ``config.json``'s
``ple_embedding_dtype`` set to the new format. Engram (DeepSeek's names): ``...engram.embed.weight``
F8_E4M3 with its F8_E8M0 ``.scale`` (``config.json`` unchanged: the loader reads the format from
the tensors). Every other tensor is copied as it is, every other file of a model folder too.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..codecs.quantize import (
    QuantizedTable,
    default_scale,
    quantize_table,
    quantize_target,
    table_amax,
)
from ..formats import BY_SAFETENSORS, ENGRAM, QWEN4EXP, encoded_format
from ..hashing.config import NGramConfig
from ..hashing.engram_config import EngramConfig
from ..hashing.layout import layer_layout
from ..runtime import interrupts
from ..runtime.atomic import remove_stale_temporaries, temporary_name
from ..runtime.model_paths import local_path
from .checkpoint_discovery import ple_prefixes
from .checkpoint_names import table_key
from .checkpoint_reading import table_shards, verify_buffers
from .engram_checkpoint import FLOAT_TABLES, engram_tensor_name
from .safetensors_files import Checkpoint, write_checkpoint

SCHEMES = ("qwen4exp", "engram")


def float_shard(checkpoint: Checkpoint, name: str) -> np.ndarray:
    """A float32 / float16 / bfloat16 tensor mapped from its file (no copy); a ValueError for
    tables already quantised."""
    dtype = checkpoint.info(name).dtype
    if dtype not in FLOAT_TABLES:
        raise ValueError(f"{name} is {dtype}: only F32, F16 and BF16 tables are quantised")
    return checkpoint.view(name).view(BY_SAFETENSORS[dtype].dtype)


def quantize_shards(shards: Sequence[np.ndarray], to: str, step: Callable[[int], None],
                    names: Sequence[str]) -> list[QuantizedTable]:
    """The shards of one table quantised under one scale (fp8, NVFP4: from the amax of them
    all); a non-finite row is a ValueError naming its tensor."""
    fmt = encoded_format(to)
    scale = None
    if fmt.scaled:
        scale = default_scale(fmt, max((table_amax(s, name=n) for s, n in zip(shards, names,
                                                                            strict=True)),
                                       default=0.0))
    results = []
    for shard, name in zip(shards, names, strict=True):
        try:
            results.append(quantize_table(shard, to, scale=scale, progress=step))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return results


def qwen4exp_tensors(checkpoint: Checkpoint, source: str, to: str, layers, step) -> tuple[
        dict, set, dict]:
    """The quantised tensors of the chosen PLE layers, the names they replace, and the
    ``config.json`` changes."""
    config = NGramConfig.from_hf(source)
    fmt = encoded_format(to)
    quantize_target(fmt, QWEN4EXP)
    names_of = fmt.checkpoint_names(QWEN4EXP)
    prefixes = ple_prefixes(checkpoint.tensors)
    if not prefixes:
        raise ValueError(f"{source} has no PLE layers (no *.ngram_embedding.shard_N.weight)")
    layers = range(len(prefixes)) if layers is None else layers
    tensors, replaced = {}, set()
    for layer in layers:  # the PLE prefixes in decoder order (transformers' or vLLM's names)
        if not 0 <= layer < len(prefixes):
            raise ValueError(f"layer {layer} is beyond the checkpoint's {len(prefixes)} PLE "
                             "layers")
        layout, prefix = layer_layout(config, layer), prefixes[layer]
        verify_buffers(checkpoint, prefix, layout)
        _, shard_names = table_shards(checkpoint, prefix, layout)
        names = [name for name in shard_names if name is not None]
        quantized = quantize_shards([float_shard(checkpoint, n) for n in names], to, step, names)
        for name, q in zip(names, quantized, strict=True):
            index = int(name.rsplit("shard_", 1)[1].split(".")[0])
            tensors[name] = q.weight
            if names_of.block_scales:
                tensors[table_key(prefix, names_of.block_scales, index)] = q.block_scales
            replaced.add(name)
        tensors[table_key(prefix, names_of.scale)] = np.array(
            quantized[0].scale if quantized else 1.0, np.float32)
    return tensors, replaced, {"ple_embedding_dtype": fmt.name}


def engram_tensors(checkpoint: Checkpoint, source: str, to: str, layers, step) -> tuple[
        dict, set, dict]:
    """The MXFP8 tensors of the chosen Engram layers and the names they replace."""
    config = EngramConfig.from_hf(source)
    quantize_target(encoded_format(to), ENGRAM)
    layer_ids = config.engram_layer_ids
    chosen = range(len(layer_ids)) if layers is None else layers
    tensors, replaced = {}, set()
    for index in chosen:
        if not 0 <= index < len(layer_ids):
            raise ValueError(f"layer {index} is beyond the config's {len(layer_ids)} Engram "
                             "layers")
        name = engram_tensor_name(checkpoint.tensors, layer_ids[index])
        if name is None:
            raise ValueError(f"{source} has no layers.{layer_ids[index]}.engram.embed.weight")
        (q,) = quantize_shards([float_shard(checkpoint, name)], to, step, [name])
        names = encoded_format(to).checkpoint_names(ENGRAM)
        tensors[name] = q.weight
        tensors[name.removesuffix(names.rows) + names.block_scales] = q.block_scales
        replaced.add(name)
    return tensors, replaced, {}


def rows_to_quantize(checkpoint: Checkpoint) -> int:
    """Rows of every float table tensor (the progress bar's total)."""
    return sum(checkpoint.info(n).shape[0] for n in checkpoint.tensors
               if ("ngram_embedding.shard_" in n or n.endswith("engram.embed.weight"))
               and checkpoint.info(n).dtype in FLOAT_TABLES)


def quantize_checkpoint(source: str | os.PathLike, to: str, output: str | os.PathLike,
                        layers: Sequence[int] | None = None, scheme: str = "qwen4exp",
                        progress: bool | None = None) -> str:
    """Write ``source``'s model (a folder with ``config.json``, or a Hugging Face Hub id: see
    ``local_path``) with the n-gram tables of ``layers`` (default: all) quantised to ``to`` into
    the new folder ``output``, atomically: a folder beside it, renamed onto it once complete
    (removed on any error or interrupt). Return ``output``."""
    output = Path(output)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    encoded_format(to, "--to")
    if output.exists() or output.is_symlink():
        raise FileExistsError(f"OUTPUT {output} exists: quantize writes a new folder")
    if not output.parent.is_dir():
        raise FileNotFoundError(f"output folder does not exist: {output.parent}")
    source = Path(local_path(source, "model folder"))
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} is not a model folder (no config.json)")
    checkpoint = Checkpoint.open(source, random_access=True)
    with tqdm(total=rows_to_quantize(checkpoint), unit="rows", unit_scale=True,
              desc=f"quantize to {to}", disable=None if progress is None else not progress,
              delay=1.0) as bar:
        def step(rows: int) -> None:
            interrupts.check()
            bar.update(rows)

        build = qwen4exp_tensors if scheme == "qwen4exp" else engram_tensors
        tensors, replaced, changes = build(checkpoint, str(source), to, layers, step)
    for name in checkpoint.tensors:
        if name not in replaced and name not in tensors:
            tensors[name] = checkpoint.view(name)
    remove_stale_temporaries(output.parent)  # a killed run's folder
    temporary = Path(temporary_name(output))
    temporary.mkdir()
    try:
        for entry in source.iterdir():
            if entry.is_file() and not entry.name.endswith(".safetensors") \
                    and entry.name != "model.safetensors.index.json":
                shutil.copy2(entry, temporary / entry.name)
        write_checkpoint(temporary, tensors, 1)
        write_config_changes(temporary / "config.json", changes)
        interrupts.check()
        os.rename(temporary, output)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return str(output)


def write_config_changes(path: Path, changes: dict) -> None:
    """Set ``changes`` in a ``config.json`` (and in its ``text_config``, where it has one)."""
    if not changes:
        return
    config = json.loads(path.read_text())
    config.update(changes)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].update(changes)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
