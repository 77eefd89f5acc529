"""The torch layers' work as registered torch ops (``torch.ops.ngram_cupy.*``), so that
``torch.compile``, CUDA graphs and ``torch.export`` see one opaque call per step instead of
tracing into NumPy, Numba and CuPy code.

A table is not a tensor: every op takes ``handle``, the integer key of a layer's ``LayerStep``
(``layer.py``) in the one registry of live objects (``runtime/handles.py``, held weakly), so
schemas stay plain and a graph never holds the table, and fake (meta) implementations allocate
only their outputs from the step's shapes. A step offers ``layout``, ``embedding`` (the lookups:
``NGramEmbedding``), ``table`` (the stored rows) and ``rows`` (``TrainableRows`` or None). Ops:

- ``ngram_ids(handle, input_ids, query_start_loc, ngram_context) -> Tensor``: ``[T, H]`` int64
  row ids of a packed batch (``query_start_loc`` None: ``[B, S]`` rows, one sequence each);
- ``lookup_(handle, ids, out!) -> ()``: the rows of ``ids`` into ``out`` (its dtype picks the
  output format), joining a prefetch of the same ``out``;
- ``prefetch_(handle, ids, out!) -> ()``: start gathering into ``out`` (a side CUDA stream or
  a CPU worker); the ``lookup_`` given the same ``out`` joins it;
- ``dequantize(handle, rows, block_scales, dtype) -> Tensor``: stored rows decoded as a lookup
  decodes them;
- ``trainable_lookup(handle, weight, ids, dtype, fused) -> Tensor``: a lookup recorded for
  autograd, whose backward is ``row_gradient`` (a sparse COO gradient of ``weight``) or, with
  ``fused``, ``optimizer_step_`` (the fused row optimizer updates the rows in place);
- ``row_gradient(handle, ids, grad_out) -> Tensor`` and
  ``optimizer_step_(handle, ids, grad_out, weight!) -> ()``.

Both torch layers (``NGramEmbeddingModule``, transformers' ``CachedNGramEmbedding``) run their
step through these in eager mode too, so compiled and eager runs share every kernel and give the
same bits.
"""

from __future__ import annotations

from typing import Any

import torch

from ..formats import output_format
from ..runtime.handles import resolve
from ..tables.table import EmbeddingTable
from .op_arguments import (
    check_integers,
    check_output_gradient,
    check_row_ids,
    check_stored_rows,
    check_weight,
)

# torch dtypes NumPy has no type for -> the integer type of their width.
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
         torch.float8_e8m0fnu: torch.uint8}


def _stream(device: torch.device) -> Any:
    """torch's current CUDA stream of ``device``, or None on the CPU."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _array(tensor: torch.Tensor | None) -> Any:
    """A CPU tensor as the NumPy array sharing its memory (types NumPy lacks as same-width
    integer bits), which the library takes without importing it; a GPU tensor as it is."""
    if tensor is None or tensor.device.type != "cpu":
        return tensor
    if tensor.dtype in _BITS:
        tensor = tensor.view(_BITS[tensor.dtype])
    return tensor.numpy()


def _ngram_ids(handle, input_ids, query_start_loc, ngram_context):
    embedding = resolve(handle).embedding
    check_integers("input_ids", input_ids, (1, 2))
    check_integers("query_start_loc", query_start_loc, (1,))
    check_integers("ngram_context", ngram_context, (2,))
    heads = embedding.layout.num_heads
    out = torch.empty((input_ids.numel(), heads), dtype=torch.int64, device=input_ids.device)
    shaped = out.view(*input_ids.shape, heads) if query_start_loc is None else out
    embedding.compute_ids(_array(input_ids), _array(query_start_loc), _array(ngram_context),
                          out=_array(shaped), stream=_stream(input_ids.device))
    return out


def _ngram_ids_fake(handle, input_ids, query_start_loc, ngram_context):
    heads = resolve(handle).layout.num_heads
    return input_ids.new_empty((input_ids.numel(), heads), dtype=torch.int64)


def _rows_into(handle: int, ids: torch.Tensor, out: torch.Tensor,
               prefetch: bool = False) -> None:
    """The step's rows of ``ids`` into ``out`` in ``out``'s dtype (``NGramEmbedding.lookup_rows``,
    which joins a prefetch), or a prefetch of them (a trainable step notes it first)."""
    step = resolve(handle)
    if prefetch and step.rows is not None:
        step.rows.prefetch_started()
    call = step.embedding.prefetch_rows if prefetch else step.embedding.lookup_rows
    call(_array(ids), out=_array(out), out_dtype=output_format(out.dtype).name,
         stream=_stream(ids.device))


def _lookup(handle, ids, out):
    _rows_into(handle, ids, out)


def _prefetch(handle, ids, out):
    _rows_into(handle, ids, out, prefetch=True)


def _nothing(*args):
    return None


def _rows_read_fake(handle, *args):
    """A traced read of the rows (``torch.export``, ``torch.compile``): the program holds the
    table's rows as its state, so the updates issued before the trace land first."""
    resolve(handle).table.wait_for_updates()


def _dequantize(handle, rows, block_scales, dtype):
    table = resolve(handle).table
    fmt = table.format
    check_stored_rows(fmt, table.head_dim, rows, block_scales)
    width = max(table.head_dim // fmt.pack, 1)
    flat = rows.detach().reshape(-1, width).contiguous()
    scales = None if block_scales is None else \
        block_scales.detach().reshape(flat.shape[0], -1).contiguous()
    decoder = EmbeddingTable(flat, scale=table.scale, placement="gpu" if flat.is_cuda else "cpu",
                             scale_rounding=table.scale_rounding, dtype=fmt.name,
                             block_scales=scales)
    ids = torch.arange(flat.shape[0], device=flat.device).reshape(-1, 1)
    decoded = decoder.lookup(ids, out_dtype=output_format(dtype).name)
    return decoded.reshape(*rows.shape[:-1], rows.shape[-1] * fmt.pack)


def _dequantize_fake(handle, rows, block_scales, dtype):
    pack = resolve(handle).table.format.pack
    return rows.new_empty((*rows.shape[:-1], rows.shape[-1] * pack), dtype=dtype)


def _trainable_inputs(handle, ids, grad_out=None, weight=None):
    """The step's ``TrainableRows`` once the trainable ops' arguments are checked."""
    step = resolve(handle)
    check_row_ids(ids, step.layout.num_heads)
    if grad_out is not None:
        check_output_gradient(grad_out, ids, step.table.head_dim)
    if weight is not None:
        check_weight(weight, step.rows.weights.weight)
    return step.rows


def _trainable_lookup(handle, weight, ids, dtype, fused):
    rows = _trainable_inputs(handle, ids, weight=weight)
    out = torch.empty((ids.shape[0], ids.shape[1] * rows.table.head_dim), dtype=dtype,
                      device=ids.device)
    rows.table.lookup(_array(ids), out=_array(out), out_dtype=output_format(dtype).name,
                      stream=_stream(ids.device))
    return rows.fresh(ids, out)


def _trainable_lookup_fake(handle, weight, ids, dtype, fused):
    _rows_read_fake(handle)
    head_dim = resolve(handle).rows.table.head_dim
    return ids.new_empty((ids.shape[0], ids.shape[1] * head_dim), dtype=dtype)


def _row_gradient(handle, ids, grad_out):
    gradient = _trainable_inputs(handle, ids, grad_out).backward(ids, grad_out)
    if gradient is None:
        raise RuntimeError("a fused optimizer was attached after this graph was traced: call "
                           "torch.compiler.reset() or compile again")
    return gradient


def _row_gradient_fake(handle, ids, grad_out):
    # The number of distinct rows is data-dependent; a sparse fake with none stands for it
    # (a sparse tensor cannot carry an unbacked size through AOT autograd).
    weight = resolve(handle).rows.weights.weight
    return torch.sparse_coo_tensor(
        torch.empty((1, 0), dtype=torch.int64, device=grad_out.device),
        grad_out.new_empty((0, weight.shape[1]), dtype=weight.dtype), tuple(weight.shape),
        is_coalesced=True, check_invariants=False)


def _optimizer_step(handle, ids, grad_out, weight):
    rows = _trainable_inputs(handle, ids, grad_out, weight)
    if rows.backward(ids, grad_out) is not None:
        raise RuntimeError("the fused optimizer was detached after this graph was traced: "
                           "call torch.compiler.reset() or compile again")
    table = rows.weights.weight.detach()
    if weight.data_ptr() != table.data_ptr():  # a functional copy that compile writes back
        touched = ids.reshape(-1).unique().to(table.device)
        weight[touched.to(weight.device)] = table[touched].to(weight.device)


# name: (schema, implementation, fake). Defined with ``torch.library.Library`` rather than
# ``custom_op``: an eager call then costs ~3 us of dispatch instead of ~100 us.
OPS = {
    "ngram_ids": ("(int handle, Tensor input_ids, Tensor? query_start_loc, "
                  "Tensor? ngram_context) -> Tensor", _ngram_ids, _ngram_ids_fake),
    "lookup_": ("(int handle, Tensor ids, Tensor(a!) out) -> ()", _lookup, _rows_read_fake),
    "prefetch_": ("(int handle, Tensor ids, Tensor(a!) out) -> ()", _prefetch, _rows_read_fake),
    "dequantize": ("(int handle, Tensor rows, Tensor? block_scales, ScalarType dtype) -> Tensor",
                   _dequantize, _dequantize_fake),
    "trainable_lookup": ("(int handle, Tensor weight, Tensor ids, ScalarType dtype, bool fused) "
                         "-> Tensor", _trainable_lookup, _trainable_lookup_fake),
    "row_gradient": ("(int handle, Tensor ids, Tensor grad_out) -> Tensor", _row_gradient,
                     _row_gradient_fake),
    "optimizer_step_": ("(int handle, Tensor ids, Tensor grad_out, Tensor(a!) weight) -> ()",
                        _optimizer_step, _nothing),
}
_LIBRARY = torch.library.Library("ngram_cupy", "DEF")  # the ops live as long as this module
for _name, (_schema, _impl, _fake) in OPS.items():
    _LIBRARY.define(_name + _schema)
    _LIBRARY.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ngram_cupy::{_name}", _fake, lib=_LIBRARY)


def _save_lookup(ctx, inputs, output) -> None:
    """What the backward needs: the handle, the ids, the weight (a fused step updates it)."""
    handle, weight, ids, _, fused = inputs
    ctx.handle, ctx.fused = handle, fused
    ctx.save_for_backward(ids, weight)


def _lookup_backward(ctx, grad_out):
    """The weight's sparse gradient, or None after the fused optimizer's step."""
    ids, weight = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    if ctx.fused:
        torch.ops.ngram_cupy.optimizer_step_(ctx.handle, ids, grad_out, weight)
        return None, None, None, None, None
    return None, torch.ops.ngram_cupy.row_gradient(ctx.handle, ids, grad_out), None, None, None


torch.library.register_autograd("ngram_cupy::trainable_lookup", _lookup_backward,
                                setup_context=_save_lookup, lib=_LIBRARY)


def ids(handle: int, input_ids: torch.Tensor, query_start_loc: torch.Tensor | None,
        ngram_context: torch.Tensor | None) -> torch.Tensor:
    """``ngram_ids``: ``[input_ids.numel(), num_heads]`` int64 ids of a packed batch (of
    ``[B, S]`` rows when ``query_start_loc`` is None) on the device of ``input_ids``."""
    return torch.ops.ngram_cupy.ngram_ids(handle, input_ids, query_start_loc, ngram_context)


def lookup(handle: int, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``lookup_``: the rows of ``ids`` ``[T, H]`` into ``out`` ``[T, H * head_dim]``, returned."""
    torch.ops.ngram_cupy.lookup_(handle, ids, out)
    return out


def prefetch(handle: int, ids: torch.Tensor, out: torch.Tensor) -> None:
    """``prefetch_``: start gathering the rows of ``ids`` into ``out``; ``lookup`` of ``out``
    joins it."""
    torch.ops.ngram_cupy.prefetch_(handle, ids, out)


def trainable_lookup(handle: int, weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype,
                     fused: bool) -> torch.Tensor:
    """``trainable_lookup``: the rows of ``ids`` in ``dtype``, recorded for autograd against
    ``weight`` (``fused``: the backward steps the attached optimizer instead)."""
    return torch.ops.ngram_cupy.trainable_lookup(handle, weight, ids, dtype, fused)


def decode(handle: int, rows: torch.Tensor, block_scales: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    """``dequantize``: stored rows decoded to ``dtype`` by the table's format and scale, through
    the table gather itself (``TableWeights.dequantize`` checked them)."""
    return torch.ops.ngram_cupy.dequantize(handle, rows, block_scales, dtype)
