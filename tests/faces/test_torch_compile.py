"""torch.compile over the registered ops: one graph, eager bits, no table copy, opcheck.

Compiling dominates the time here, so one model holds a layer of every placement and format and
is compiled once for the whole module, by AOTAutograd without Inductor (``aot_eager``: the ops'
fake kernels, functionalization and mutations, as Inductor sees them); one smaller model runs
through Inductor itself, bit for bit. Token-count and graph-break checks use dynamo's own
counting backends, which stop before Inductor.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import ngram_cupy as nc
from ngram_cupy.memory import shared as shared_memory
from ngram_cupy.torch import NGramEmbeddingModule, fused_optimizer, opcheck_samples

# Heads 2 x 2 of head_dim 32: every format's blocks (NVFP4 16 values, MXFP8 32) fit a row.
CONFIG = nc.NGramConfig(vocab_size=60, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
                        eos_token_id=1, embedding_dim=128, seed=11,
                        make_ngram_vocab_size_divisible_by=4, split_ngram_parts=2)
# (placement, weight_dtype, hot_rows): every placement on float8, every format on the CPU.
LAYERS = [("cpu", "float32", None), ("cpu", "bfloat16", None), ("cpu", "float8_e4m3fn", None),
          ("cpu", "nvfp4", None), ("cpu", "mxfp8", None), ("pinned", "float8_e4m3fn", None),
          ("shared", "float8_e4m3fn", None), ("cpu", "float8_e4m3fn", [0, 3, 5, 9, 40])]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: the code compiled for earlier tests' layers (other
    handles) would count against dynamo's recompile limit and could leave a layer eager."""
    torch._dynamo.reset()


def filled(placement="cpu", weight_dtype="float32", hot_rows=None, seed=0, **options):
    """A layer whose rows (and block scales, and scale) are random bits, loaded through
    ``load_state_dict`` so that a shared layer moves them into its node segment."""
    layer = NGramEmbeddingModule(CONFIG, 0, placement=placement, weight_dtype=weight_dtype,
                                 hot_rows=hot_rows, **options)
    generator = torch.Generator().manual_seed(seed)
    state = layer.state_dict()
    for name, value in state.items():
        if name.endswith("weight") or name.endswith("weight_scale") and value.ndim == 2:
            bits = torch.randint(0, 120, value.shape, dtype=torch.uint8, generator=generator)
            if value.element_size() == 1:
                state[name] = bits.view(value.dtype)
            else:
                state[name] = torch.randn(value.shape, generator=generator).to(value.dtype)
    if layer.scale_name is not None:
        state[layer.scale_name] = torch.tensor(0.375)
    layer.load_state_dict(state)
    return layer


def token_batch(num_tokens, requests=2, seed=0):
    """A packed batch of ``num_tokens`` tokens in ``requests`` requests."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, CONFIG.vocab_size, (num_tokens,), generator=generator)
    requests = min(requests, num_tokens)
    starts = torch.linspace(0, num_tokens, requests + 1).round().long()
    context = torch.randint(0, CONFIG.vocab_size, (requests, 2), generator=generator)
    return input_ids, starts, context


def tensor_bits(tensor):
    """A tensor's bits as integers (NaN payloads compare too)."""
    return tensor.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[
        tensor.element_size()])


class EveryLayer(torch.nn.Module):
    """A layer of each placement and format, a prefetching one and a stored-rows one whose
    rows ``dequantize`` decodes, all called on one batch."""

    def __init__(self, specs=LAYERS):
        super().__init__()
        self.layers = torch.nn.ModuleList(filled(*spec, seed=i) for i, spec in enumerate(specs))
        self.prefetching = filled("pinned", "bfloat16", seed=20)
        self.stored = filled("cpu", "float8_e4m3fn", seed=21, return_stored_rows=True)

    def forward(self, input_ids, query_start_loc, ngram_context):
        outs = [layer(input_ids, query_start_loc, ngram_context) for layer in self.layers]
        self.prefetching.start_prefetch(input_ids, query_start_loc, ngram_context)
        outs.append(self.prefetching(input_ids, query_start_loc, ngram_context))
        outs.append(self.stored.dequantize(self.stored(input_ids, query_start_loc,
                                                       ngram_context), torch.bfloat16))
        return outs


@pytest.fixture(scope="module")
def every_layer(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("shm"))
    previous = os.environ.get(shared_memory.SHM_DIR_ENV)
    os.environ[shared_memory.SHM_DIR_ENV] = folder
    try:
        model = EveryLayer()
    finally:
        if previous is None:
            del os.environ[shared_memory.SHM_DIR_ENV]
        else:
            os.environ[shared_memory.SHM_DIR_ENV] = previous
    assert model.layers[6].table.placement == "shared"
    yield model


def test_one_graph_without_breaks(every_layer):
    explained = torch._dynamo.explain(every_layer)(*token_batch(9))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    called = " ".join(str(node.target) for graph in explained.graphs
                      for node in graph.graph.nodes if node.op == "call_function")
    for op in ("ngram_ids", "lookup_", "prefetch_", "dequantize"):
        assert f"ngram_cupy.{op}" in called


def assert_compiled_equals_eager(model, backend: str) -> None:
    """``model`` compiled once by ``backend`` (dynamic in the token count) gives eager's bits
    for every output, at two token counts."""
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for num_tokens in (5, 37):
        args = token_batch(num_tokens, requests=3, seed=num_tokens)
        with torch.no_grad():
            want = model(*args)
            got = compiled(*args)
        assert len(got) == len(want) == len(model.layers) + 2
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == w.dtype and torch.equal(tensor_bits(g), tensor_bits(w)), index


def test_every_layer_compiled_equals_eager_bit_for_bit(every_layer):
    assert_compiled_equals_eager(every_layer, "aot_eager")


def test_inductor_equals_eager_bit_for_bit():
    """Inductor's own code around the ops (buffers it allocates, reinplaced mutations, the
    prefetch's side effect, a dequantize it may fuse with) on a float8 layer, a prefetching
    layer and a stored-rows one."""
    assert_compiled_equals_eager(EveryLayer([("cpu", "float8_e4m3fn", None)]), "inductor")


def test_token_counts_compile_at_most_twice():
    layer = filled("cpu", "bfloat16")
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for num_tokens in (1, 16, 64, 256, 8192):  # decode steps, then a prefill
        args = token_batch(num_tokens, requests=2, seed=num_tokens)
        assert torch.equal(tensor_bits(compiled(*args)), tensor_bits(layer(*args)))
    assert counter.frame_count <= 2


def trained(fused: bool):
    """A trainable float32 layer, with the SGD fused optimizer or sparse gradients."""
    layer = filled("cpu", "float32", seed=3, trainable=True)
    if fused:
        fused_optimizer(layer, "sgd", lr=0.25)
    return layer


@pytest.mark.parametrize("fused", [False, True], ids=["sparse_gradient", "fused_optimizer"])
def test_training_under_compile_equals_eager(fused):
    eager, compiled_layer = trained(fused), trained(fused)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    args = token_batch(11, requests=2, seed=4)
    weights = torch.randn(11, CONFIG.embedding_dim, generator=torch.Generator().manual_seed(1))
    for call in (eager, compiled):
        (call(*args) * weights).sum().backward()
    eager_weight = eager.ngram_embedding.weight
    compiled_weight = compiled_layer.ngram_embedding.weight
    if fused:
        assert eager_weight.grad is None and compiled_weight.grad is None
        assert torch.equal(compiled_weight.detach(), eager_weight.detach())
        untrained = trained(False).ngram_embedding.weight.detach()
        assert not torch.equal(eager_weight.detach(), untrained)  # the step changed rows
    else:
        got, want = compiled_weight.grad, eager_weight.grad
        assert got.is_sparse and want.is_sparse
        got, want = got.coalesce(), want.coalesce()  # both are: this only sets the flag
        assert torch.equal(got.indices(), want.indices())
        assert torch.equal(got.values(), want.values())


@pytest.mark.parametrize("sample", list(opcheck_samples()),
                         ids=lambda sample: str(sample[0]) if isinstance(sample, tuple) else "")
def test_opcheck(sample):
    op, args, kwargs = sample
    torch.library.opcheck(op, args, kwargs)


def test_every_op_has_a_sample():
    ops = {str(op).split(".")[1] for op, _, _ in opcheck_samples()}
    assert ops == {name for name in dir(torch.ops.ngram_cupy)
                   if isinstance(getattr(torch.ops.ngram_cupy, name), torch._ops.OpOverloadPacket)}


def test_a_dead_handle_is_a_clear_error():
    layer = filled()
    handle = layer.handle
    del layer
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {handle} names no live layer"):
        torch.ops.ngram_cupy.ngram_ids(handle, *token_batch(3))
    foreign = handle & (1 << 32) - 1  # the same counter under another process's tag (none)
    with pytest.raises(RuntimeError, match=f"handle {foreign} was made by another process"):
        torch.ops.ngram_cupy.ngram_ids(foreign, *token_batch(3))


def peak_bytes() -> int:
    """This process's peak resident set (VmHWM)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_compiling_does_not_copy_the_table():
    """Peak RSS across an Inductor compile of a layer over a ~200 MB table grows by far less
    than the table (a copy, as Inductor makes of a weight it inlines, would double it)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the resident set now
    except OSError:
        pytest.skip("no /proc/self/clear_refs to reset the peak resident set")
    config = nc.NGramConfig(vocab_size=1000, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=400_000, eos_token_id=1, embedding_dim=512,
                            seed=1, split_ngram_parts=1)
    layer = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float32")
    layer.ngram_embedding.weight.data.fill_(0.5)
    args = (torch.arange(64) % 1000, torch.tensor([0, 64]), torch.tensor([[1, 1]]))
    assert layer.table.nbytes > 150 * 2**20
    layer(*args)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = peak_bytes()
    out = torch.compile(layer, fullgraph=True)(*args)
    assert bool((out == 0.5).all())
    assert peak_bytes() - before < layer.table.nbytes / 4


@pytest.fixture(scope="module")
def qwen4exp_pair():
    """transformers' tiny Qwen4Exp (test_transformers) cut to its two kinds of decoder layer, one
    of them with a PLE (Dynamo traces each layer), and a copy using ngram_cupy tables."""
    pytest.importorskip("transformers")
    from test_transformers import tiny_model

    from ngram_cupy.transformers import use_ngram_cupy

    reference = tiny_model(num_hidden_layers=2, ple_layer_ids=[1],
                           layer_types=["linear_attention", "indexed_attention"])
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched, placement="cpu")
    return reference, patched


def test_the_transformers_layer_is_one_graph(qwen4exp_pair):
    from test_transformers import ple_names, prompts
    from transformers import DynamicCache

    _, patched = qwen4exp_pair
    layer = patched.get_submodule(ple_names(patched.config)[0])
    cache = DynamicCache(config=patched.config)
    explained = torch._dynamo.explain(layer)(prompts(), cache)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@pytest.fixture(scope="module")
def compiled_qwen4exp(qwen4exp_pair):
    """The patched model compiled in place (``model.compile()``, so that ``generate``'s calls
    run compiled too; compiling the plain model changes neither its logits nor its tokens on
    the CPU), shared: each shape is traced once."""
    model = qwen4exp_pair[1]
    model.compile(backend="eager")
    return model


def assert_no_break_of_ours() -> None:
    """No graph break in this library's code (the model's MoE routing breaks graphs by itself:
    ``nonzero``)."""
    reasons = " ".join(torch._dynamo.utils.counters["graph_break"])
    assert "ngram_cupy" not in reasons and "CachedNGramEmbedding" not in reasons


def test_the_compiled_transformers_model_gives_eager_logits(qwen4exp_pair, compiled_qwen4exp):
    from test_transformers import prompts

    torch._dynamo.utils.counters.clear()
    input_ids = prompts()
    with torch.no_grad():
        assert torch.equal(compiled_qwen4exp(input_ids).logits, qwen4exp_pair[0](input_ids).logits)
    assert_no_break_of_ours()


def test_the_compiled_transformers_model_generates_eager_tokens(qwen4exp_pair,
                                                                compiled_qwen4exp):
    """``generate`` through the compiled patched model: eager's greedy tokens, and its per-step
    logits within float32 rounding of eager's (compiling the plain model alike moves its own
    logits by 1.5e-8 here, and the patched model's by exactly as much: Dynamo reorders the
    model's float32 arithmetic, not this library's)."""
    from test_transformers import generated, prompts

    torch._dynamo.utils.counters.clear()
    input_ids = prompts()
    # Two tokens: the prefill and a decode step through the cache (each length is traced).
    want, got = generated(qwen4exp_pair[0], input_ids, 2), generated(compiled_qwen4exp,
                                                                     input_ids, 2)
    assert_no_break_of_ours()
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


# Loads a saved exported program in a fresh process whose own layer holds the same handle
# counter as the exporting process's layer: running it must name the foreign handle.
FOREIGN_RUN = """
import sys, torch
import ngram_cupy as nc
from ngram_cupy.runtime import handles
from ngram_cupy.torch import NGramEmbeddingModule
path, handle, config = sys.argv[1], int(sys.argv[2]), eval("nc." + sys.argv[3])
low = (1 << 32) - 1
kept = [type("Target", (), {})() for _ in range(handle & low)]
while handles.register(kept.pop()) & low < (handle & low) - 1:
    pass
layer = NGramEmbeddingModule(config, 0, placement="cpu")
assert layer.handle & low == handle & low, (layer.handle, handle)
program = torch.export.load(path).module()
try:
    program(torch.tensor([3, 4, 5]), torch.tensor([0, 3]), torch.zeros((1, 2), dtype=torch.long))
except RuntimeError as error:
    print(error)
"""


def test_torch_export_keeps_the_ops(tmp_path):
    """``torch.export.export`` of a layer, dynamic in the token and request counts: the ops in
    its graph (the handle a constant of this process), and eager bits on another batch; saved
    and loaded in another process, whose own layer has the same handle counter, it is refused
    naming the handle instead of running on that layer."""
    layer = filled("cpu", "float8_e4m3fn", seed=7)
    tokens, requests = torch.export.Dim("tokens"), torch.export.Dim("requests")
    exported = torch.export.export(layer, token_batch(10, requests=2), dynamic_shapes=(
        {0: tokens}, {0: requests + 1}, {0: requests}))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"ngram_cupy.ngram_ids.default", "ngram_cupy.lookup_.default"} <= targets
    args = token_batch(33, requests=3, seed=2)
    assert torch.equal(tensor_bits(exported.module()(*args)), tensor_bits(layer(*args)))
    torch.export.save(exported, tmp_path / "layer.pt2")
    run = subprocess.run([sys.executable, "-c", FOREIGN_RUN, str(tmp_path / "layer.pt2"),
                          str(layer.handle), repr(CONFIG)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"handle {layer.handle} was made by another process" in run.stdout
