"""``ngram_cupy.jax``'s functions: ids, table lookups and row training from JAX programs
(docs/jax.md).

Each function takes and returns JAX arrays, eagerly or under ``jax.jit``, and runs the NumPy
face's own code as one XLA custom call (``ffi.py``): the buffers are handed over in place, no
copy either way, and a jitted call gives the bits of the eager one. Eager calls wait for their
result and raise the library's own exceptions; under ``jax.jit`` a failure is a
``jax.errors.JaxRuntimeError`` whose message begins with the exception's type and message.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import default_output, output_format
from ..ids import engram_ids, ngram_ids
from .ffi import custom_call

if TYPE_CHECKING:
    from ..hashing.engram_layout import EngramLayout
    from ..hashing.layout import LayerLayout
    from ..tables.table import EmbeddingTable
    from ..training.optimizers import RowOptimizer

__all__ = ["compute_engram_ids", "compute_ngram_ids", "id_dtype", "lookup", "lookup_dtype",
           "step_from_output_grad"]

_INT32_ROWS = (1 << 31) - 1


def _array(name: str, value: Any) -> jax.Array:
    """A JAX array as it is (traced or not); anything else copied in (``jnp.asarray``), after a
    ValueError naming ``name`` for 64-bit integers that JAX's 32-bit mode would wrap."""
    if isinstance(value, jax.Array):
        return value
    host = np.asarray(value)
    if host.dtype.kind in "iu" and host.dtype.itemsize == 8 and host.size \
            and not jax.config.jax_enable_x64:
        info = np.iinfo(np.int32)
        if host.min() < info.min or host.max() > info.max:
            raise ValueError(f"{name} holds {host.dtype} values outside int32 (the largest "
                             f"{host.max()}), which JAX's 32-bit mode would wrap: enable 64-bit "
                             "ids with jax.config.update('jax_enable_x64', True)")
    return jnp.asarray(host)


def _arrays(**values: Any) -> dict[str, jax.Array]:
    """The named arguments that are not None, as JAX arrays, in order."""
    return {name: _array(name, value) for name, value in values.items() if value is not None}


def _integers(name: str, array: jax.Array, ndims: tuple[int, ...]) -> None:
    """A TypeError / ValueError naming ``array`` unless it is an integer array of those ranks."""
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {array.dtype}")
    if array.ndim not in ndims:
        ranks = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {ranks}, got shape {tuple(array.shape)}")


def id_dtype(num_rows: int) -> np.dtype:
    """The dtype of the ids of a table of ``num_rows`` rows: int64 under ``jax_enable_x64``,
    else int32 (JAX's default), which holds every row below 2**31; beyond, a ValueError."""
    if jax.config.jax_enable_x64:
        return np.dtype(np.int64)
    if num_rows > _INT32_ROWS:
        raise ValueError(f"the layout has {num_rows:,} rows, more than int32 ids hold: enable "
                         "64-bit ids with jax.config.update('jax_enable_x64', True)")
    return np.dtype(np.int32)


def _ngram_ids(layout: LayerLayout, names: tuple[str, ...], inputs: list, outputs: list,
               stream: Any) -> None:
    """Run ``nc.compute_ngram_ids`` on the call's buffers, into its result (int64 ids in
    place; int32 ids through one int64 pass)."""
    arguments = dict(zip(names, inputs, strict=True))
    out = outputs[0]
    if out.dtype == np.int64:
        ngram_ids.compute_ngram_ids(layout, **arguments, out=out, stream=stream)
        return
    ids = ngram_ids.compute_ngram_ids(layout, **arguments, stream=stream)
    with stream if stream is not None else contextlib.nullcontext():
        out[...] = ids.astype(out.dtype)


def compute_ngram_ids(layout: LayerLayout, input_ids, query_start_loc=None,
                      ngram_context=None) -> jax.Array:
    """``nc.compute_ngram_ids`` for JAX arrays: the same arguments and values, ``[T,
    num_heads]`` (``[B, S, num_heads]`` for ``[B, S]`` rows) of ``id_dtype(layout.num_rows)``:
    int32 unless ``jax_enable_x64`` is on (then int64, as NumPy's)."""
    arrays = _arrays(input_ids=input_ids, query_start_loc=query_start_loc,
                     ngram_context=ngram_context)
    tokens = arrays["input_ids"]
    _integers("input_ids", tokens, (1, 2))
    dtype = id_dtype(layout.num_rows)
    shape = (*tokens.shape, layout.num_heads)
    if tokens.ndim == 1 and query_start_loc is None:
        raise ValueError("query_start_loc is required for 1-D input_ids (a packed batch)")
    (ids,) = custom_call(layout, _ngram_ids, tuple(arrays), [jax.ShapeDtypeStruct(shape, dtype)],
                         *arrays.values())
    return ids


def _engram_ids(layout: EngramLayout, names: tuple[str, ...], inputs: list, outputs: list,
                stream: Any) -> None:
    """Run ``nc.compute_engram_ids`` on the call's buffers, into its int32 result."""
    engram_ids.compute_engram_ids(layout, **dict(zip(names, inputs, strict=True)),
                                  out=outputs[0], stream=stream)


def compute_engram_ids(layout: EngramLayout, input_ids, positions, query_start_loc,
                       lookback_token_ids=None, dead_mask=None,
                       lookback_dead_mask=None) -> jax.Array:
    """``nc.compute_engram_ids`` for JAX arrays: the same arguments and values, ``[T, L, H]``
    int32 ids (as NumPy's, with or without ``jax_enable_x64``)."""
    arrays = _arrays(input_ids=input_ids, positions=positions, query_start_loc=query_start_loc,
                     lookback_token_ids=lookback_token_ids, dead_mask=dead_mask,
                     lookback_dead_mask=lookback_dead_mask)
    tokens = arrays["input_ids"]
    _integers("input_ids", tokens, (1,))
    shape = (tokens.shape[0], layout.num_layers, layout.num_heads)
    (ids,) = custom_call(layout, _engram_ids, tuple(arrays),
                         [jax.ShapeDtypeStruct(shape, np.int32)], *arrays.values())
    return ids


def _lookup(table: EmbeddingTable, out_dtype: tuple, inputs: list, outputs: list,
            stream: Any) -> None:
    """Run ``table.lookup`` on the call's ids, into its result."""
    table.lookup(inputs[0], out=outputs[0], out_dtype=out_dtype[0], stream=stream)


def lookup_dtype(table: EmbeddingTable, out_dtype=None) -> np.dtype:
    """The dtype ``lookup(table, ids, out_dtype)`` returns: ``table.lookup``'s (float32 for
    float32 tables, float16 for float16, bfloat16 for the others, unless ``out_dtype``)."""
    fmt = default_output(table.format) if out_dtype is None else output_format(out_dtype)
    return fmt.dtype


def lookup(table: EmbeddingTable, ids, out_dtype=None) -> jax.Array:
    """``table.lookup(ids, out_dtype=out_dtype)`` for JAX ids ``[T, H]`` (int32 or int64): the
    same bits, ``[T, H * head_dim]`` of ``lookup_dtype(table, out_dtype)``; any table (every
    placement and format, hot rows, shared). Ids outside ``[0, total_rows)`` raise the
    table's IndexError: at once on the host; from the GPU at the table's next call once the GPU
    has run the lookup, or at ``table.check()`` (the GPU never waits for the host)."""
    ids = _array("ids", ids)
    _integers("ids", ids, (2,))
    dtype = lookup_dtype(table, out_dtype)
    shape = (ids.shape[0], ids.shape[1] * table.head_dim)
    (rows,) = custom_call(table, _lookup, (None if out_dtype is None else dtype,),
                          [jax.ShapeDtypeStruct(shape, dtype)], ids)
    return rows


def _step(optimizer: RowOptimizer, extra: tuple, inputs: list, outputs: list,
          stream: Any) -> None:
    """Run ``optimizer.step_from_output_grad`` on the call's ids and gradient; write the step
    count after it. An asynchronous optimizer checks the step here, once the earlier ones have
    landed (``checked_step``), and its worker applies a copy of a host gradient: XLA reuses the
    call's buffers as soon as it returns."""
    ids, grad = inputs
    if optimizer.worker is None:
        optimizer.step_from_output_grad(ids, grad)
        outputs[0][...] = optimizer.steps
        return
    update = optimizer.checked_step(ids, grad.copy() if stream is None else grad)
    steps = optimizer.steps + 1
    update()
    outputs[0][...] = steps


def step_from_output_grad(optimizer: RowOptimizer, ids, grad_out) -> jax.Array:
    """``optimizer.step_from_output_grad(ids, grad_out)`` (an ``nc.SGD``, ``nc.RowwiseAdagrad``
    or ``nc.Adam``) for JAX arrays: updates the table's rows in place, eagerly or as an effect
    of a jitted function that XLA never drops or merges, run once its inputs (the gradient) are
    computed. Returns the optimizer's step count after it, an int32 scalar that is ready once
    the rows are written."""
    ids, grad_out = _array("ids", ids), _array("grad_out", grad_out)
    _integers("ids", ids, (1, 2))
    (steps,) = custom_call(optimizer, _step, (), [jax.ShapeDtypeStruct((), np.int32)], ids,
                           grad_out, side_effect=True)
    return steps
