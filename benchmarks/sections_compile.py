"""``torch.compile`` of the torch layer against eager, on the CPU.

One float8 PLE layer (16 heads of 160 values, a 51 MB table, bf16 rows out) called on a decode
step of 256 tokens and a prefill of 8,192, eager and compiled with Inductor
(``fullgraph=True``), in paired rounds; the target is compiled <= 1.05x eager. Dispatch
overhead: one call of a one-token batch, eager and compiled, beside the library's own call of
the same ids and gather without torch (``NGramEmbedding`` on NumPy arrays) and beside what
torch.compile adds to any module's call (a compiled ``Linear(4, 4)``).
"""

from __future__ import annotations

from .report import Row, Section
from .timers import paired, timeit


def bench_torch_compile(quick: bool) -> Section:
    """Compiled against eager forward, and the per-call overhead of each."""
    import torch

    import ngram_cupy as nc
    from ngram_cupy.torch import NGramEmbeddingModule

    section = Section("torch.compile (Inductor, fullgraph) of NGramEmbeddingModule against "
                      "eager, CPU: fp8 table of 16 x 160, bf16 rows", "cpu")
    config = nc.NGramConfig(vocab_size=248320, ngram_size=3, heads_per_ngram=8,
                            ngram_vocab_size_base=20_000, eos_token_id=248044,
                            embedding_dim=2560)
    layer = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float8_e4m3fn")
    weight = layer.ngram_embedding.weight
    generator = torch.Generator().manual_seed(0)
    weight.view(torch.uint8).copy_(torch.randint(0, 120, weight.shape, dtype=torch.uint8,
                                                 generator=generator))
    layer.ngram_embedding.set_scale(torch.tensor(0.5))
    compiled = torch.compile(layer, fullgraph=True)

    def inputs(tokens: int, requests: int):
        return (torch.randint(0, config.vocab_size, (tokens,), generator=generator),
                torch.linspace(0, tokens, requests + 1).round().long(),
                torch.randint(0, config.vocab_size, (requests, 2), generator=generator))

    min_time = 0.5 if quick else 2.0
    with torch.no_grad():
        for name, tokens, requests in (("decode step", 256, 256), ("prefill", 8192, 4)):
            args = inputs(tokens, requests)
            if not torch.equal(compiled(*args).view(torch.int16), layer(*args).view(torch.int16)):
                raise AssertionError(f"{name}: compiled rows differ from eager")
            eager, fast, ratio = paired(lambda args=args: layer(*args),
                                        lambda args=args: compiled(*args), min_time=min_time)
            section.rows.append(Row(f"{name}, {tokens:,} tokens: eager", eager,
                                    f"{tokens / eager:,.0f} token/s", "baseline", tokens))
            section.rows.append(Row(f"{name}, {tokens:,} tokens: compiled", fast,
                                    f"{tokens / fast:,.0f} token/s",
                                    f"{1 / ratio:.3f}x eager (paired median; target <= 1.05x)",
                                    tokens))
        one = inputs(1, 1)
        bare = layer.embedding
        numpy_args = tuple(a.numpy() for a in one)
        floor = timeit(lambda: bare(*numpy_args), min_time=min_time)
        for name, call in (("eager", layer), ("compiled", compiled)):
            seconds = timeit(lambda call=call: call(*one), min_time=min_time)
            section.rows.append(Row(f"one token: {name} call", seconds,
                                    f"{(seconds - floor) * 1e6:,.1f} us over the library call",
                                    "dispatch overhead: module and ops (and guards, compiled)"))
        section.rows.append(Row("one token: the library's own call (NumPy, no torch)", floor,
                                "", "ids + gather floor"))
        linear, x = torch.nn.Linear(4, 4), torch.ones(1, 4)
        compiled_linear = torch.compile(linear, fullgraph=True)
        compiled_linear(x)
        plain, fast = timeit(lambda: linear(x), min_time=min_time), \
            timeit(lambda: compiled_linear(x), min_time=min_time)
        section.rows.append(Row("torch.compile's own cost: a compiled Linear(4, 4)", fast,
                                f"{(fast - plain) * 1e6:,.1f} us over eager",
                                "any compiled module's call, for reference"))
    return section
