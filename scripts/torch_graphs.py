"""The torch layer on a GPU under CUDA graphs, against eager (scripts/device_check.sh, step
torch-graphs):

- ``torch.compile(layer, mode="reduce-overhead", fullgraph=True)`` (Inductor's CUDA graphs) of
  a gpu and a pinned float8 layer over decode sizes 1, 64 and 256, three calls each;
- a ``torch.cuda.graph`` capture of ``start_prefetch`` and ``forward`` of the pinned layer,
  replayed on new tokens;
- a lookup captured with an id outside the table: nothing raised during capture or replay, the
  IndexError at ``check()``.

Each result is compared bit for bit with the eager layer. Prints one line per case; exit 1 if any
failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from gpu_workload import main  # the same runner: one line per case, exit 1 if any failed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, not installed

import ngram_cupy as nc  # noqa: E402
from ngram_cupy.torch import NGramEmbeddingModule  # noqa: E402

CONFIG = nc.NGramConfig(vocab_size=248320, ngram_size=3, heads_per_ngram=8,
                        ngram_vocab_size_base=2_000, eos_token_id=248044, embedding_dim=2560)


def layer(placement: str) -> NGramEmbeddingModule:
    """A float8 layer of random rows and scale 0.5 in ``placement``."""
    module = NGramEmbeddingModule(CONFIG, 0, placement=placement, weight_dtype="float8_e4m3fn")
    state = module.state_dict()
    generator = torch.Generator().manual_seed(0)
    state["ngram_embedding.weight"] = torch.randint(
        0, 120, state["ngram_embedding.weight"].shape, dtype=torch.uint8,
        generator=generator).view(torch.float8_e4m3fn)
    state["ngram_embedding.weight_scale"] = torch.tensor(0.5)
    module.load_state_dict(state)
    return module


def batch(num_tokens: int, seed: int):
    """A packed batch of ``num_tokens`` tokens in up to 4 requests, on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    requests = min(4, num_tokens)
    return (torch.randint(0, CONFIG.vocab_size, (num_tokens,), generator=generator).cuda(),
            torch.linspace(0, num_tokens, requests + 1).round().long().cuda(),
            torch.randint(0, CONFIG.vocab_size, (requests, 2), generator=generator).cuda())


def same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        raise AssertionError(f"{what}: compiled / captured rows differ from eager")


def case_reduce_overhead() -> None:
    for placement in ("gpu", "pinned"):
        module = layer(placement)
        compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
        for num_tokens in (1, 64, 256):
            for call in range(3):
                args = batch(num_tokens, seed=10 * num_tokens + call)
                want = module(*args).clone()
                got = compiled(*args).clone()
                same_bits(got, want, f"{placement}, {num_tokens} tokens, call {call}")


def case_cuda_graph() -> None:
    module = layer("pinned")
    static = batch(64, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels, staging, the persistent words
        for _ in range(2):
            module.start_prefetch(*static)
            module(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.start_prefetch(*static)
        out = module(*static)
    for seed in (2, 3):
        fresh = batch(64, seed=seed)
        for target, value in zip(static, fresh, strict=True):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        same_bits(out, module(*fresh), f"captured prefetch + forward, replay {seed}")


def case_captured_bad_id() -> None:
    table = nc.EmbeddingTable(torch.zeros((100, 64), dtype=torch.bfloat16, device="cuda"),
                              placement="gpu")
    ids = torch.zeros((8, 2), dtype=torch.int64, device="cuda")
    out = torch.empty((8, 128), dtype=torch.bfloat16, device="cuda")
    table.lookup(ids, out=out)  # outside a capture: the word is made here
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table.lookup(ids, out=out)
    ids[3, 1] = 100
    graph.replay()  # no host read: nothing raised here
    torch.cuda.synchronize()
    try:
        table.check()
    except IndexError as error:
        if "position 7" not in str(error):
            raise AssertionError(f"the wrong position: {error}") from None
    else:
        raise AssertionError("check() did not raise for the replayed bad id")
    table.check()  # raised once


CASES = {"reduce-overhead": case_reduce_overhead, "cuda-graph": case_cuda_graph,
         "captured-bad-id": case_captured_bad_id}


if __name__ == "__main__":
    sys.exit(main(list(CASES), CASES))
