"""Which transformers releases ``ngram_cupy.transformers`` works with: the tested range, a
warning past it, and clear errors for releases whose Qwen4Exp n-gram layer it cannot replace."""

from __future__ import annotations

import functools
import inspect
import warnings

import transformers
from packaging.version import Version

try:
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding
except ImportError as error:  # a release that renamed or dropped the layer this replaces
    raise ImportError(f"transformers {transformers.__version__} has no Qwen4ExpTextNGramEmbedding "
                      "for ngram_cupy.transformers to replace; it is tested with transformers "
                      "5.23 to 5.25") from error

# The oldest and newest transformers releases (major, minor) the integration is tested with.
TESTED_RELEASES = ((5, 23), (5, 25))
# What this module reads of transformers' layer: its attributes and its call's leading arguments.
LAYER_ATTRIBUTES = ("layer_idx", "ple_layer_index", "ngram_embedding", "layer_multipliers",
                    "ngram_heads_vocab_sizes", "ngram_heads_offsets")
CACHE_NAMES = ("cache", "past_key_values")

def tested_range() -> str:
    """The tested transformers releases, as messages name them ("5.23 to 5.25")."""
    (low_major, low_minor), (high_major, high_minor) = TESTED_RELEASES
    return f"{low_major}.{low_minor} to {high_major}.{high_minor}"


@functools.cache
def check_release(version: str) -> None:
    """Refuse a release older than the tested range; warn once per release newer than it;
    refuse one whose n-gram layer no longer has the call this module replaces (naming the
    release)."""
    release = Version(version).release[:2]
    if release < TESTED_RELEASES[0]:
        raise RuntimeError(f"transformers {version} is older than the releases ngram_cupy's "
                           f"Qwen4Exp integration supports ({tested_range()}): its cache keeps "
                           "the n-gram context differently; upgrade transformers")
    if release > TESTED_RELEASES[1]:
        warnings.warn(f"transformers {version} is newer than the releases ngram_cupy's "
                      f"Qwen4Exp integration is tested with ({tested_range()}); the layers are "
                      "checked before they are replaced, but compare the logits with the "
                      "model's own once", UserWarning, stacklevel=3)
    leading = list(inspect.signature(Qwen4ExpTextNGramEmbedding.forward).parameters)[1:3]
    if len(leading) < 2 or leading[1] not in CACHE_NAMES:
        unlike_tested(f"its forward takes ({', '.join(leading)})")


def unlike_tested(found: str):
    """Refuse a transformers release whose n-gram layer differs from the tested ones."""
    raise RuntimeError(f"transformers {transformers.__version__}'s Qwen4ExpTextNGramEmbedding is "
                       f"not the layer ngram_cupy replaces ({found}); use_ngram_cupy is tested "
                       f"with transformers {tested_range()}")


def check_layers(targets) -> None:
    """Refuse (naming the release) layers that lack an attribute the replacement reads."""
    for name, module in targets:
        missing = [attribute for attribute in LAYER_ATTRIBUTES if not hasattr(module, attribute)]
        if missing:
            unlike_tested(f"{name} lacks {', '.join(missing)}")
