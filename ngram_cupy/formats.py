"""The registry of table storage formats: one entry per format is its codec, everything the
package knows about what a table of that format stores.

For each format: the code every kernel is compiled for (the same numbers in
``kernels/dequant.cuh``), its NumPy / ``ml_dtypes`` type, the unsigned type of its bits (what
CuPy, DLPack and the kernels move), its torch dtype name, its safetensors dtype code, whether
it can be an output type, its packing and block scales, and the tensors a table of it stores
under the names each model family gives them (``TensorNames``): the torch layer's buffers (vLLM's
Qwen4Exp parameter names), and the checkpoints of each family that hold it. The torch module, the
transformers adapter and the checkpoint loaders ask these entries; none of them names a format.

Adding a format is one entry here plus its decoding: ``dequant.py`` (the plain NumPy definition
every path is tested against), the Numba row decoder in ``codecs/row_decoders.py`` and
``kernels/dequant.cuh``; ``tests/codecs/test_decoders.py`` checks every entry's decoders against
each other, and docs/tables.md says the same.

A block-scaled format (NVFP4 and MXFP8, docs/tables.md) packs ``pack`` values per stored byte
and keeps one scale byte per ``block`` values in a second array beside the rows (``[rows,
head_dim / block]``, carried by every storage); its value is ``(value * block scale) * scale``
in float32. Such formats are found by name only: their bytes are plain ``uint8`` (or float8) to
NumPy and safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

# Format codes: compile-time constants of every kernel (the same numbers in dequant.cuh).
FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3, NVFP4, MXFP8 = 0, 1, 2, 3, 4, 5


# Model families whose checkpoints hold tables, by the names of docs/checkpoints.md and
# docs/engram.md: Qwen4Exp PLE layers (vLLM, transformers) and DeepSeek's Engram.
QWEN4EXP, ENGRAM = "Qwen4Exp", "Engram"


@dataclass(frozen=True)
class TensorNames:
    """What a model family calls a table's tensors: the rows, their block scales (a row of
    scales per row) and the table's one float scale; None where the format stores no such
    tensor. ``{index}`` in a name is a checkpoint shard's number."""

    rows: str = "weight"
    block_scales: str | None = None
    scale: str | None = None

    def sharded(self) -> TensorNames:
        """The names of a checkpoint that splits the rows (and their block scales) into
        ``shard_{index}`` tensors, as Qwen4Exp checkpoints do; the scale stays whole."""
        def shard(name: str | None) -> str | None:
            return None if name is None else "shard_{index}." + name
        return TensorNames(shard(self.rows), shard(self.block_scales), self.scale)


@dataclass(frozen=True)
class Format:
    """One storage or output format of table values."""

    code: int
    dtype: np.dtype  # NumPy / ml_dtypes type of the values
    raw: np.dtype  # unsigned type of the same width: the bits
    torch_name: str  # attribute of the ``torch`` module
    safetensors: str  # dtype code in safetensors headers
    output: bool  # lookups can produce it
    label: str = ""  # the format's name; "" gives the dtype's (packed formats have their own)
    pack: int = 1  # values per stored element
    block: int = 0  # values per block scale; 0: no block scales
    block_scale: Any = None  # ml_dtypes type of the block scale bytes
    block_scale_safetensors: str = ""  # their dtype code in checkpoints
    # The torch layer's buffers under ``ngram_embedding.`` (vLLM's Qwen4Exp parameter names).
    layer_names: TensorNames = TensorNames()
    # (family, names) of the checkpoints that hold tables of this format.
    checkpoints: tuple[tuple[str, TensorNames], ...] = ()
    # The output format that holds every stored value exactly (a lookup of the stored rows
    # gathers in it and casts back); None where stored values are not values by themselves.
    exact_output: int | None = None
    # The name ``quantize_table`` (and ``ngram-cupy quantize --to``) takes for encoding float
    # tables into this format, which names its encoder in ``codecs/``; "" where none encodes.
    encoder: str = ""
    # Other names of the format (``find_format``): the one table of spellings.
    aliases: tuple[str, ...] = ()

    def checkpoint_names(self, family: str) -> TensorNames | None:
        """The names ``family``'s checkpoints give this format's tensors; None when its
        checkpoints hold no such table."""
        return dict(self.checkpoints).get(family)

    def __post_init__(self) -> None:
        """Every format is labelled: the dtype's name where no label is given."""
        if not self.label:
            object.__setattr__(self, "label", self.dtype.name)

    def __repr__(self) -> str:
        """The format's name (``float8_e4m3fn``, ``nvfp4``), as every function accepts it."""
        return self.name

    @property
    def name(self) -> str:
        """The NumPy / ml_dtypes name, e.g. ``float8_e4m3fn``, or the label (``nvfp4``)."""
        return self.label

    @property
    def scaled(self) -> bool:
        """Whether tables of this format carry one float scale (float8's, NVFP4's global)."""
        return self.layer_names.scale is not None

    @property
    def blocked(self) -> bool:
        """Whether rows carry block scales in a second array."""
        return self.block > 0

    def row_width(self, head_dim: int) -> int:
        """Stored elements per row of ``head_dim`` values."""
        return head_dim // self.pack

    def scale_width(self, head_dim: int) -> int:
        """Block scale bytes per row (0 without block scales)."""
        return head_dim // self.block if self.block else 0

    def row_bytes(self, head_dim: int) -> int:
        """Bytes per row, block scales included (NVFP4 head_dim 160: 80 + 10)."""
        return self.row_width(head_dim) * self.itemsize + self.scale_width(head_dim)

    def check_head_dim(self, head_dim: int, name: str = "head_dim") -> None:
        """Packed and block-scaled rows need whole bytes and whole blocks: a ValueError."""
        unit = max(self.pack, self.block)
        if unit > 1 and head_dim % unit:
            raise ValueError(f"{self.name} tables need a head_dim that is a multiple of {unit} "
                             f"({name} gives {head_dim})")

    @property
    def itemsize(self) -> int:
        """Bytes per value."""
        return self.dtype.itemsize

    @property
    def torch_dtype(self):
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.torch_name)


PLAIN_NAMES = TensorNames()  # rows alone, in every family
FP8_NAMES = TensorNames(scale="weight_scale")  # vLLM's per-tensor scale
NVFP4_NAMES = TensorNames(block_scales="weight_scale", scale="weight_scale_2")  # and a global
MXFP8_NAMES = TensorNames(block_scales="weight_scale")  # vLLM's names for block scales alone
ENGRAM_BLOCK_NAMES = TensorNames(block_scales="scale")  # DeepSeek's ``embed.weight, .scale``
FLOAT_CHECKPOINTS = ((QWEN4EXP, PLAIN_NAMES.sharded()), (ENGRAM, PLAIN_NAMES))

FORMATS = (
    Format(FLOAT32, np.dtype(np.float32), np.dtype(np.uint32), "float32", "F32", True,
           checkpoints=FLOAT_CHECKPOINTS, exact_output=FLOAT32, aliases=("f32",)),
    Format(FLOAT16, np.dtype(np.float16), np.dtype(np.uint16), "float16", "F16", True,
           checkpoints=FLOAT_CHECKPOINTS, exact_output=FLOAT16, aliases=("f16", "half")),
    Format(BFLOAT16, np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16), "bfloat16", "BF16", True,
           checkpoints=FLOAT_CHECKPOINTS, exact_output=BFLOAT16, aliases=("bf16",)),
    # bfloat16 holds every E4M3 value exactly (a NaN keeps no sign).
    Format(FLOAT8_E4M3, np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8), "float8_e4m3fn",
           "F8_E4M3", False, layer_names=FP8_NAMES,
           checkpoints=((QWEN4EXP, FP8_NAMES.sharded()),), exact_output=BFLOAT16, encoder="fp8",
           aliases=("f8_e4m3", "float8_e4m3", "fp8")),
    # Two E2M1 codes a byte (low nibble first), an E4M3 scale per 16 values, a float32 global.
    Format(NVFP4, np.dtype(np.uint8), np.dtype(np.uint8), "uint8", "U8", False,
           label="nvfp4", pack=2, block=16, block_scale=np.dtype(ml_dtypes.float8_e4m3fn),
           block_scale_safetensors="F8_E4M3", layer_names=NVFP4_NAMES,
           checkpoints=((QWEN4EXP, NVFP4_NAMES.sharded()),), encoder="nvfp4"),
    # OCP MXFP8 (docs/engram.md): E4M3 values, a UE8M0 scale byte per 32 values, no global scale.
    # Qwen4Exp layers hold it in memory; their checkpoints of it are not read yet.
    Format(MXFP8, np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8), "float8_e4m3fn",
           "F8_E4M3", False, label="mxfp8", block=32,
           block_scale=np.dtype(ml_dtypes.float8_e8m0fnu), block_scale_safetensors="F8_E8M0",
           layer_names=MXFP8_NAMES, checkpoints=((ENGRAM, ENGRAM_BLOCK_NAMES),), encoder="mxfp8"),
)
OUTPUT_CODES = tuple(fmt.code for fmt in FORMATS if fmt.output)
# Formats a float8 table's scale may be stored in.
SCALE_FORMATS = tuple(fmt for fmt in FORMATS if fmt.output)
# Formats a dtype or a safetensors code names by itself (not the block-scaled ones).
PLAIN_FORMATS = tuple(fmt for fmt in FORMATS if not fmt.blocked)
BY_SAFETENSORS = {fmt.safetensors: fmt for fmt in PLAIN_FORMATS}
_ALIASES = {alias: fmt.name for fmt in FORMATS for alias in fmt.aliases}
# Formats float tables are quantised to, by their encoders' names (``quantize_table``'s ``to``).
ENCODED = {fmt.encoder: fmt for fmt in FORMATS if fmt.encoder}


def names() -> str:
    """Every format's name, for error messages."""
    return ", ".join(fmt.name for fmt in FORMATS)


def checkpoint_formats(family: str, *, blocked: bool) -> tuple[Format, ...]:
    """The formats ``family``'s checkpoints hold, block-scaled ones or the others."""
    return tuple(fmt for fmt in FORMATS if fmt.checkpoint_names(family) and fmt.blocked == blocked)


def encoded_format(to: Any, name: str = "to") -> Format:
    """The format whose encoder ``to`` names (``"fp8"``, ...) or that ``to`` names by any of its
    names and aliases (``"float8_e4m3fn"``); a ValueError naming ``name``."""
    fmt = ENCODED.get(to) if isinstance(to, str) else None
    if fmt is None and isinstance(to, str):
        fmt = find_format(to)
    if fmt is None or not fmt.encoder:
        raise ValueError(f"{name} must be one of {', '.join(ENCODED)}, got {to!r}")
    return fmt


def find_format(dtype: Any) -> Format | None:
    """The format of a NumPy / ml_dtypes / torch dtype, a name or a safetensors code (or a
    ``Format`` itself); or None. Remembered per hashable dtype: every lookup asks, and a dtype's
    name is slow to build."""
    if isinstance(dtype, Format):
        return dtype
    try:
        return _cached_format(dtype)
    except TypeError:  # unhashable: not remembered
        return _format_of(dtype)


@lru_cache(maxsize=256)
def _cached_format(dtype: Any) -> Format | None:
    """``_format_of`` remembered."""
    return _format_of(dtype)


def _format_of(dtype: Any) -> Format | None:
    """``find_format``, worked out."""
    text = str(dtype).removeprefix("torch.")
    if text in BY_SAFETENSORS:
        return BY_SAFETENSORS[text]
    text = _ALIASES.get(text.lower(), text.lower())
    for fmt in FORMATS:
        if fmt.name == text:
            return fmt
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        return None
    return next((fmt for fmt in PLAIN_FORMATS if numpy_dtype == fmt.dtype), None)


def storage_format(dtype: Any, name: str = "dtype") -> Format:
    """The storage format of ``dtype``; a TypeError naming the argument for anything else."""
    fmt = find_format(dtype)
    if fmt is None:
        raise TypeError(f"{name} must be one of {names()}, got {dtype}")
    return fmt


def output_format(dtype: Any, name: str = "out_dtype") -> Format:
    """An output format: float32, float16 or bfloat16."""
    fmt = find_format(dtype)
    if fmt is None or not fmt.output:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {dtype}")
    return fmt


def default_output(storage: Format) -> Format:
    """float32 tables give float32, float16 give float16, bfloat16 and float8 give bfloat16."""
    return storage if storage.output else FORMATS[BFLOAT16]


def holds(dtype: Any, fmt: Format) -> bool:
    """Whether an array of ``dtype`` holds ``fmt`` values: of that type, or as bits in an integer
    type of the same width."""
    dtype = np.dtype(dtype)
    return dtype == fmt.dtype or (dtype.kind in "iu" and dtype.itemsize == fmt.itemsize)


def bits_name(fmt: Format | None) -> str | None:
    """For a format NumPy has no type of its own for (bfloat16, float8), the name of the
    same-width integer type its values move as through torch and DLPack; else None."""
    if fmt is None or issubclass(fmt.dtype.type, np.floating):  # NumPy's own types pass
        return None
    return {1: "uint8", 2: "int16"}[fmt.itemsize]


def block_scale_type(torch_dtype: Any) -> np.dtype | None:
    """The ``ml_dtypes`` type of a torch dtype that only block scales have (UE8M0, which no
    table format is), or None."""
    name = str(torch_dtype).removeprefix("torch.")
    return next((fmt.block_scale for fmt in FORMATS if fmt.blocked
                 and fmt.block_scale.name == name), None)


def raw_torch_name(torch_dtype: Any) -> str | None:
    """``bits_name`` of a torch dtype; None for dtypes that are not table formats."""
    return bits_name(find_format(torch_dtype)) if str(torch_dtype).startswith("torch.") else None
