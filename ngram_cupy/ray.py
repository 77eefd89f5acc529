"""N-gram ids for Ray Data datasets: corpora spread over many machines (needs the ``ray`` extra).

``ngram_ids_dataset`` maps a ``ray.data.Dataset`` through ``map_batches`` with a callable class, so
each Ray worker builds its layouts (and tokenizer) and compiles the kernels once, then gets Arrow
batches. Every output row is exactly the row ``ngram-cupy ids`` writes for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .arrow import NGramIds
from .hashing.config import NGramConfig
from .hashing.layout import layer_layout
from .text import TextTokenizer


class NGramIdsWorker:
    """One Ray worker's state: the layouts, the tokenizer and a ``NGramIds`` mapper.

    With ``order_column`` each call gets all rows of one document (a group) and puts them in that
    column's order before computing the ids, so the document is continued row to row.
    """

    def __init__(self, config: NGramConfig, layers: Sequence[int], column: str,
                 text_column: str | None, tokenizer: str | TextTokenizer | None,
                 doc_id_column: str | None, order_column: str | None) -> None:
        layouts = [layer_layout(config, layer) for layer in layers]
        self.doc_id_column = doc_id_column
        self.order_column = order_column
        self.mapper = NGramIds(layouts, column, doc_id_column=doc_id_column,
                               text_column=text_column, tokenizer=tokenizer,
                               id_type="auto")  # the CLI's ids: int32 where they fit

    def __call__(self, table: pa.Table) -> pa.Table:
        """The id columns of ``table`` (one document's rows when grouped), as the CLI gives."""
        if self.order_column is not None:
            nulls = table.column(self.order_column).null_count
            if nulls:
                doc = table.column(self.doc_id_column)[0].as_py()
                raise ValueError(f"document {doc!r} has {nulls} null value(s) in order column "
                                 f"{self.order_column!r}: its rows have no single order")
            table = table.sort_by(self.order_column)
            order = table.column(self.order_column)
            if table.num_rows > 1 and not pc.all(pc.greater(order.slice(1),
                                                            order.slice(0, len(order) - 1))
                                                 ).as_py():
                doc = table.column(self.doc_id_column)[0].as_py()
                raise ValueError(f"document {doc!r} repeats a value of order column "
                                 f"{self.order_column!r}: its rows have no single order")
        return self.mapper(table)


def ngram_ids_dataset(dataset: Any, config: NGramConfig, layers: Sequence[int] = (0,),
                      column: str = "tokens", text_column: str | None = None,
                      tokenizer: str | TextTokenizer | None = None,
                      doc_id_column: str | None = None, *, order_column: str | None = None,
                      batch_rows: int = 256, concurrency: int | None = None,
                      num_partitions: int | None = None) -> Any:
    """``dataset`` with the n-gram id columns of ``layers`` added, row for row as the CLI.

    One layer gives a ``ngram_ids`` column, several ``ngram_ids_layer{L}``, int32 where every row
    id fits (as the CLI's default ``--id-type auto``); with ``text_column``
    and ``tokenizer`` each row's text is first encoded into ``column`` (``list<int32>``).

    Order: Ray Data runs blocks in parallel and, unless
    ``ray.data.DataContext.get_current().execution_options.preserve_order`` is set, returns them
    in any order; within a batch rows keep their order. So without ``doc_id_column`` every row is
    its own sequence and the result is exact whatever the order (keep a key column to join on).
    A document split over several rows needs its rows together and in order, which Ray cannot
    promise across blocks: give ``doc_id_column`` and ``order_column`` (the rows' position in
    their document, e.g. a chunk number) and the dataset is grouped by document (a shuffle), each
    document's rows sorted by ``order_column`` and continued exactly; the output then comes
    grouped by document. ``doc_id_column`` without ``order_column`` is refused.

    ``batch_rows`` bounds the rows per batch a worker maps (ungrouped); ``concurrency`` fixes the
    number of workers (default: Ray's autoscaling actor pool); ``num_partitions`` is the number of
    shuffle partitions of the grouping (default: Ray's).
    """
    import ray.data

    if not isinstance(config, NGramConfig):
        raise TypeError(f"config must be an NGramConfig, got {type(config).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("layers must name at least one PLE layer")
    count = len(config.ple_layer_ids) if config.ple_layer_ids is not None else None
    beyond = [layer for layer in layers if count is not None and layer >= count]
    if beyond:  # as the CLI: ids of a layer the model does not have would read no table
        raise ValueError(f"layers: {beyond[0]} is beyond the config's {count} PLE layers "
                         f"(ple_layer_ids; layers are 0-based)")
    if doc_id_column is not None and order_column is None:
        raise ValueError(
            f"doc_id_column={doc_id_column!r} needs order_column: Ray Data does not keep a "
            f"document's rows together and in order across blocks, so name the column that "
            f"orders the rows within their document (or give each row a whole document)")
    if order_column is not None and doc_id_column is None:
        raise ValueError("order_column orders rows within documents: give doc_id_column too")
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be a positive integer, got {batch_rows!r}")
    # Build one worker here: bad layers, columns or tokenizers fail now, not inside Ray.
    worker_args = dict(config=config, layers=layers, column=column, text_column=text_column,
                       tokenizer=tokenizer, doc_id_column=doc_id_column,
                       order_column=order_column)
    NGramIdsWorker(**worker_args).mapper.output_schema(dataset.schema().base_schema)
    compute = ray.data.ActorPoolStrategy(size=concurrency) if concurrency else None
    if doc_id_column is None:
        return dataset.map_batches(NGramIdsWorker, batch_size=batch_rows, compute=compute,
                                   batch_format="pyarrow", fn_constructor_kwargs=worker_args)
    return dataset.groupby(doc_id_column, num_partitions=num_partitions).map_groups(
        NGramIdsWorker, compute=compute, batch_format="pyarrow",
        fn_constructor_kwargs=worker_args)
