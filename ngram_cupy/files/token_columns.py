"""Arrow columns of tokens and of text: their types checked, the column looked up by name, and
the error a row that cannot become ids raises. The batch steps over files (``engram_parquet``)
and the faces above (``ngram_cupy.arrow``) share them."""

from __future__ import annotations

from typing import Protocol

import pyarrow as pa

TOKEN_TYPES = (pa.int32(), pa.int64())
TEXT_TYPES = (pa.string(), pa.large_string())


def check_token_type(column: str, arrow_type: pa.DataType) -> None:
    """``column`` must be a list or large list of int32/int64 tokens."""
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) or (
        arrow_type.value_type not in TOKEN_TYPES
    ):
        raise TypeError(
            f"column {column!r} must be list<int32|int64> or large_list<int32|int64>, "
            f"got {arrow_type}"
        )


def field_of(schema: pa.Schema, column: str, role: str) -> pa.Field:
    """The field named ``column``, or a ValueError saying which columns there are."""
    if schema.get_field_index(column) < 0:
        raise ValueError(f"{role} column {column!r} not found; columns are {schema.names}")
    return schema.field(column)


def check_text_type(column: str, arrow_type: pa.DataType) -> None:
    """``column`` must be a string or large string column."""
    if arrow_type not in TEXT_TYPES:
        raise TypeError(f"text column {column!r} must be string or large_string, got {arrow_type}")


class TextError(ValueError):
    """A row that cannot become ids (invalid UTF-8, a token id past int32 or outside the
    tokenizer's), named by column and row; the command line adds the file."""


class TokenStep(Protocol):
    """A batch step that appends a token column encoded from text (``ngram_cupy.arrow``'s
    ``TextTokens``), as the id steps over files take it."""

    def output_schema(self, schema: pa.Schema) -> pa.Schema:
        """``schema`` with the token column appended."""

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` with its token column appended."""
