"""use_ngram_cupy on transformers' own Qwen4Exp: bitwise the same logits and tokens.

Every comparison runs a tiny random ``Qwen4ExpForCausalLM`` (4 layers, hidden 64, PLE on decoder
layers 1 and 3) twice: as transformers ships it, whose ``nn.Embedding`` holds the table values,
and patched with this library's tables holding the same values.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    Qwen4ExpConfig,
    Qwen4ExpForCausalLM,
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpTextConfig,
    Qwen4ExpTextModel,
)

import ngram_cupy as nc  # noqa: E402
from ngram_cupy.codecs.dequant import reference_block_lookup  # noqa: E402
from ngram_cupy.files.checkpoint_writing import ngram_tensors  # noqa: E402
from ngram_cupy.files.safetensors_files import write_checkpoint  # noqa: E402
from ngram_cupy.formats import FORMATS, NVFP4  # noqa: E402
from ngram_cupy.transformers import CachedNGramEmbedding, ngram_config, use_ngram_cupy  # noqa: E402

EOS, PAD, VOCAB = 2, 0, 512
# The model takes its cache as ``cache=`` from transformers 5.25 on (``past_key_values=`` warns
# there, and goes in 5.40); the oldest supported release knows only ``past_key_values=``.
CACHE = "cache" if "cache" in inspect.signature(Qwen4ExpForCausalLM.forward).parameters \
    else "past_key_values"
pytestmark = pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")
NAMES_TEXT = ["layers.0.ple.ple_embedding", "layers.2.ple.ple_embedding"]
NAMES = [f"model.{name}" for name in NAMES_TEXT]


def tiny_config(**overrides) -> Qwen4ExpTextConfig:
    """A Qwen4Exp text config small enough to generate in well under a second on a CPU."""
    values = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, hc_count=2,
        hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=64, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=16, split_ngram_parts=4,
        eos_token_id=EOS, pad_token_id=PAD, indexer_n_heads=2, indexer_kv_heads=1,
        layer_types=["linear_attention", "indexed_attention", "linear_attention"],
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
    values.update(overrides)
    return Qwen4ExpTextConfig(**values)


def ple_names(config: Qwen4ExpTextConfig) -> list[str]:
    """The model's PLE modules (``ple_layer_ids`` count decoder layers from 1)."""
    return [f"model.layers.{layer - 1}.ple.ple_embedding" for layer in config.ple_layer_ids]


def tiny_model(dtype=torch.float32, **overrides) -> Qwen4ExpForCausalLM:
    """A random model; its PLE tables drawn large enough to move the logits."""
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name in ple_names(model.config):
            model.get_submodule(name).ngram_embedding.weight.normal_(0.0, 1.0)
    return model.to(dtype)


def ple_tables(model) -> list[torch.Tensor]:
    return [model.get_submodule(name).ngram_embedding.weight for name in NAMES]


def prompts(batch=2, length=7, seed=1) -> torch.Tensor:
    """Random tokens with EOS and a repeated n-gram among them."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 2] = EOS
    ids[:, 4:6] = ids[:, 0:2]
    return ids


def generated(model, input_ids, max_new_tokens=6, **kwargs):
    """Tokens and per-step logits of ``generate``."""
    out = model.generate(input_ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                         output_logits=True, pad_token_id=PAD, **kwargs)
    return out.sequences, torch.stack(out.logits)


def assert_same_generation(reference, patched, input_ids, **kwargs):
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    want = generated(reference, input_ids, **kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    got = generated(patched, input_ids, **kwargs)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.fixture(scope="module")
def float32_pair():
    reference = tiny_model()
    patched = copy.deepcopy(reference)
    assert use_ngram_cupy(patched) == NAMES
    return reference, patched


def test_replaces_every_ngram_embedding(float32_pair):
    _, patched = float32_pair
    kinds = {type(patched.get_submodule(name)) for name in NAMES}
    assert kinds == {CachedNGramEmbedding}
    assert not any(isinstance(m, transformers.models.qwen4_exp.modeling_qwen4_exp
                              .Qwen4ExpTextNGramEmbedding) for m in patched.modules())
    layer = patched.get_submodule(NAMES[1])
    assert layer.table.format.name == "float32"
    assert layer.table.placement == "pinned"  # ordinary host memory on a machine without a GPU


def test_a_second_call_says_the_model_already_uses_ngram_cupy(float32_pair):
    _, patched = float32_pair
    with pytest.raises(ValueError, match="already applied to this Qwen4ExpForCausalLM "
                                         r"\(model\.layers\.\d+\..*ngram_cupy's\)"):
        use_ngram_cupy(patched)


def test_float32_logits_and_greedy_generate(float32_pair):
    reference, patched = float32_pair
    ids = prompts()
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, reference(ids).logits)
    assert_same_generation(reference, patched, ids, do_sample=False)


def test_the_tables_are_read(float32_pair):
    """A different table moves the logits: the comparisons above could fail."""
    reference, _ = float32_pair
    other = copy.deepcopy(reference)
    use_ngram_cupy(other, placement="cpu")
    layer = other.get_submodule(NAMES[0])
    layer.table.write_rows(0, np.zeros((layer.table.num_rows, 16), np.float32))
    with torch.no_grad():
        assert not torch.equal(other(prompts()).logits, reference(prompts()).logits)


def test_seeded_sampling(float32_pair):
    reference, patched = float32_pair
    assert_same_generation(reference, patched, prompts(seed=5), do_sample=True, top_k=0,
                           temperature=1.5, seed=1234)


def test_left_padding_with_attention_mask(float32_pair):
    reference, patched = float32_pair
    ids = prompts(batch=3, length=8, seed=2)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 7)):  # a one-token prompt among them
        ids[row, :pad], mask[row, :pad] = PAD, 0
    assert_same_generation(reference, patched, ids, attention_mask=mask, do_sample=False)


@pytest.mark.parametrize("chunks", [(1, 1, 4, 1), (5, 2, 1), (2, 6)])
def test_chunked_prefill_through_a_dynamic_cache(float32_pair, chunks):
    """Chunks shorter than n-1 on a fresh cache (EOS-padded context), then longer ones."""
    reference, patched = float32_pair
    ids = prompts(batch=2, length=sum(chunks), seed=3)
    caches = [DynamicCache(config=m.config) for m in (reference, patched)]
    start = 0
    for size in chunks:
        chunk = ids[:, start:start + size]
        with torch.no_grad():
            want, got = (m(chunk, **{CACHE: c}, use_cache=True).logits
                         for m, c in zip((reference, patched), caches, strict=True))
        assert torch.equal(got, want)
        start += size
    for layer_idx in (0, 2):
        assert torch.equal(caches[1].get_conv_state(layer_idx, 2),
                           caches[0].get_conv_state(layer_idx, 2))


@pytest.mark.parametrize("dtype, overrides, options", [
    (torch.float32, {}, dict(num_beams=3, do_sample=False)),  # beams reorder the cache
    (torch.float16, dict(ngram_size=4, heads_per_ngram=3, ple_embed_dim=72,
                         eos_token_id=[EOS, 5]), dict(do_sample=False)),
])
def test_beam_search_and_other_layouts(dtype, overrides, options):
    reference = tiny_model(dtype, **overrides)
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched)
    assert_same_generation(reference, patched, prompts(), **options)


@pytest.mark.release_independent
def test_bfloat16_model_and_table():
    reference = tiny_model(torch.bfloat16)
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched)
    assert patched.get_submodule(NAMES[0]).table.format.name == "bfloat16"
    assert_same_generation(reference, patched, prompts(), do_sample=False)


@pytest.mark.release_independent
def test_bfloat16_table_in_a_float32_model():
    """weight_dtype rounds the rows once; the model's own table rounded alike agrees."""
    reference = tiny_model()
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched, weight_dtype=torch.bfloat16, placement="cpu")
    with torch.no_grad():
        for weight in ple_tables(reference):
            weight.copy_(weight.to(torch.bfloat16).float())
    assert_same_generation(reference, patched, prompts(), do_sample=False)


def fp8_checkpoint(model, path, scale=0.0625, scale_dtype=ml_dtypes.bfloat16):
    """Both PLE layers in float8 with a scale (default: bf16-exact, the released layout);
    returns the dequantised tables (float32 products)."""
    config = ngram_config(model.config)
    tensors, dequantised = {}, []
    for layer, (name, weight) in enumerate(zip(NAMES, ple_tables(model), strict=True)):
        rows = (weight.detach().float() / scale).numpy().astype(ml_dtypes.float8_e4m3fn)
        layout = nc.layer_layout(config, layer)
        tensors.update(ngram_tensors(layout, rows, np.array(scale, scale_dtype), prefix=name))
        dequantised.append(torch.from_numpy(rows.astype(np.float32)) * scale)
    write_checkpoint(str(path), tensors, 2)
    return dequantised


@pytest.mark.release_independent
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_checkpoint(tmp_path, dtype):
    """An fp8 table against a model whose nn.Embedding holds the dequantised rows."""
    reference = tiny_model(dtype)
    patched = copy.deepcopy(reference)
    dequantised = fp8_checkpoint(reference, tmp_path / "fp8")
    with torch.no_grad():
        for weight, rows in zip(ple_tables(reference), dequantised, strict=True):
            weight.copy_(rows.to(dtype))
    use_ngram_cupy(patched, checkpoint=tmp_path / "fp8")
    layer = patched.get_submodule(NAMES[0])
    assert layer.table.format.name == "float8_e4m3fn" and float(layer.table.scale) == 0.0625
    assert_same_generation(reference, patched, prompts(), do_sample=False)


@pytest.mark.release_independent
@pytest.mark.parametrize("scale_rounding", ["output", "float32"])
def test_float8_checkpoint_with_vllms_float32_scale(tmp_path, scale_rounding):
    """vLLM 0.33's float32 scale that bf16 cannot hold: by default rows.to(bf16) *
    scale.to(bf16) as vLLM dequantises; with scale_rounding="float32" one rounding of the float32
    product."""
    scale = np.float32(1.3883328)
    reference = tiny_model(torch.bfloat16)
    patched = copy.deepcopy(reference)
    fp8_checkpoint(reference, tmp_path / "fp8", float(scale), np.float32)
    with torch.no_grad():
        for weight in ple_tables(reference):
            rows = (weight.float() / float(scale)).to(torch.float8_e4m3fn).float()
            if scale_rounding == "output":
                weight.copy_(rows.to(torch.bfloat16) * torch.tensor(scale).to(torch.bfloat16))
            else:
                weight.copy_((rows * torch.tensor(scale)).to(torch.bfloat16))
    use_ngram_cupy(patched, checkpoint=tmp_path / "fp8", scale_rounding=scale_rounding)
    assert patched.get_submodule(NAMES[0]).table.scale_rounding == scale_rounding
    assert_same_generation(reference, patched, prompts(), do_sample=False)


def nvfp4_checkpoint(model, path, scale=0.75):
    """Both PLE layers as NVFP4 tables in vLLM's names (random packed codes, E4M3 block scales
    around 1, a float32 global scale), one file each by ``save_ngram_embedding``; returns the
    files and the tables decoded by the plain reference (SPEC 10.2), in float32."""
    config, rng = ngram_config(model.config), np.random.default_rng(10)
    files, decoded = [], []
    for layer, name in enumerate(NAMES):
        layout = nc.layer_layout(config, layer)
        packed = rng.integers(0, 256, (layout.padded_rows, layout.head_dim // 2), dtype=np.uint8)
        blocks = rng.uniform(0.25, 4.0, (layout.padded_rows, layout.head_dim // 16))
        blocks = blocks.astype(ml_dtypes.float8_e4m3fn)
        files += nc.save_ngram_embedding(path / f"layer_{layer}.safetensors", config, layer,
                                         packed, np.float32(scale), prefix=name,
                                         block_scales=blocks)
        decoded.append(torch.from_numpy(reference_block_lookup(
            FORMATS[NVFP4], packed, blocks, scale, np.arange(layout.padded_rows), np.float32)))
    return files, decoded


@pytest.mark.release_independent
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_checkpoint(tmp_path, dtype):
    """An NVFP4 table against a model whose nn.Embedding holds its rows decoded in float32 (one
    rounding to bf16, as the lookup rounds once)."""
    reference = tiny_model(dtype)
    patched = copy.deepcopy(reference)
    files, decoded = nvfp4_checkpoint(reference, tmp_path)
    with torch.no_grad():
        for weight, rows in zip(ple_tables(reference), decoded, strict=True):
            weight.copy_(rows.to(dtype))
    use_ngram_cupy(patched, checkpoint=files, placement="cpu")
    layer = patched.get_submodule(NAMES[1])
    assert layer.table.format.name == "nvfp4" and float(layer.table.scale) == 0.75
    state = layer.state_dict()  # vLLM's buffers: packed rows, block scales, global scale
    assert state["ngram_embedding.weight_scale"].dtype == torch.float8_e4m3fn
    assert state["ngram_embedding.weight_scale"].shape == (layer.table.num_rows, 1)
    assert float(state["ngram_embedding.weight_scale_2"]) == 0.75
    ids = prompts()
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, reference(ids).logits)
    assert_same_generation(reference, patched, ids, do_sample=False)


def test_save_pretrained_then_checkpoint(tmp_path, float32_pair):
    """transformers' own save (the shard layout), tables read from it into a model whose
    tables are on the meta device."""
    reference, _ = float32_pair
    reference.save_pretrained(tmp_path / "saved")
    patched = copy.deepcopy(reference)
    for name in NAMES:
        patched.get_submodule(name).ngram_embedding.to("meta")
    use_ngram_cupy(patched, checkpoint=tmp_path / "saved", placement="mmap")
    assert_same_generation(reference, patched, prompts(), do_sample=False)


def test_save_pretrained_then_load_every_ple_layer_without_prefix(tmp_path, float32_pair):
    """``ple_layer_ids`` [1, 3] as transformers writes them (from 1) find the modules
    ``layers.0`` and ``layers.2`` of its own save, layer by layer, with no ``prefix=``."""
    reference, _ = float32_pair
    reference.save_pretrained(tmp_path / "saved")
    config = nc.NGramConfig.from_hf(tmp_path / "saved")
    assert config.ple_layer_ids == (1, 3)
    for layer, want in enumerate(ple_tables(reference)):
        table = nc.load_ngram_embedding(tmp_path / "saved", config, layer=layer,
                                        placement="cpu").table
        ids = np.arange(len(want)).reshape(-1, 1)
        got = torch.from_numpy(np.asarray(table.lookup(ids, out_dtype=np.float32)))
        assert torch.equal(got.reshape(want.shape), want.detach())


@pytest.mark.release_independent
def test_single_weight_layout(tmp_path, float32_pair):
    """A table saved whole, as ``P.ngram_embedding.weight`` (the model's state_dict)."""
    reference, _ = float32_pair
    state = {k: v for k, v in reference.state_dict().items() if ".ple.ple_embedding." in k}
    save_file(state, tmp_path / "model.safetensors")
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched, checkpoint=tmp_path / "model.safetensors", placement="cpu")
    assert_same_generation(reference, patched, prompts(), do_sample=False)


@pytest.mark.release_independent
@pytest.mark.parametrize("source", ["model", "single_weight"])
def test_shared_placement(tmp_path, shm_dir, float32_pair, source):
    """placement="shared" (issue 24) from the model's own rows or a single-weight checkpoint:
    the same generation, one node segment per table, none left once the tables close."""
    from ngram_cupy.memory import shared as shared_memory

    reference, _ = float32_pair
    patched = copy.deepcopy(reference)
    options = {}
    if source == "single_weight":
        state = {k: v for k, v in reference.state_dict().items() if ".ple.ple_embedding." in k}
        save_file(state, tmp_path / "model.safetensors")
        options["checkpoint"] = tmp_path / "model.safetensors"
    use_ngram_cupy(patched, placement="shared", hot_rows={0: np.array([5, 900])}, **options)
    assert_same_generation(reference, patched, prompts(), do_sample=False)
    for name in NAMES:
        assert patched.get_submodule(name).table.placement == "shared"
    assert len(shared_memory.own_segments(shm_dir)) == len(NAMES)
    for name in NAMES:
        patched.get_submodule(name).table.close()  # shm_dir checks that none is left


@pytest.mark.release_independent
def test_prefetch_and_hot_rows_change_nothing(float32_pair):
    reference, _ = float32_pair
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched, prefetch=True, hot_rows={NAMES[1]: np.arange(0, 4000, 7),
                                                     0: np.array([5, 900, 2000])})
    assert_same_generation(reference, patched, prompts(seed=9), do_sample=False)
    assert patched.get_submodule(NAMES[1]).table.counters["hot_rows"] > 0


def test_other_qwen4exp_classes(tmp_path):
    """The text model alone and the vision-language model: their n-gram embeddings too, the
    latter's under ``model.language_model``, read back from its own save."""
    torch.manual_seed(0)
    text = Qwen4ExpTextModel(tiny_config()).eval()
    patched = copy.deepcopy(text)
    assert use_ngram_cupy(patched) == NAMES_TEXT
    ids = prompts()
    with torch.no_grad():
        assert torch.equal(patched(ids).last_hidden_state, text(ids).last_hidden_state)
    config = Qwen4ExpConfig(text_config=tiny_config().to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
        num_position_embeddings=16))
    torch.manual_seed(0)
    vl = Qwen4ExpForConditionalGeneration(config).eval()
    vl.save_pretrained(tmp_path / "vl")
    patched = copy.deepcopy(vl)
    names = use_ngram_cupy(patched, checkpoint=tmp_path / "vl")
    assert names == [f"model.language_model.{name}" for name in NAMES_TEXT]
    assert_same_generation(vl, patched, ids, do_sample=False)


def test_state_dict_keys_are_transformers(float32_pair):
    reference, patched = float32_pair
    assert set(patched.state_dict()) == set(reference.state_dict())
    key = f"{NAMES[0]}.ngram_embedding.weight"
    assert torch.equal(patched.state_dict()[key], reference.state_dict()[key])


def test_ids_equal_transformers_own(float32_pair):
    """The batched [B, S] ids with a per-row context are the rows transformers reads: its
    table filled with each row's index shows them, chunk after chunk through the cache."""
    reference, patched = float32_pair
    ours = patched.get_submodule(NAMES[1])
    theirs = copy.deepcopy(reference.get_submodule(NAMES[1]))
    with torch.no_grad():
        theirs.ngram_embedding.weight.copy_(
            torch.arange(theirs.ngram_embedding.weight.shape[0]).float()[:, None].expand(-1, 16))
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(4))
    ids[ids % 5 == 0] = EOS
    cache = DynamicCache(config=reference.config)
    context = None
    for start, stop in ((0, 1), (1, 5), (5, 6), (6, 9)):
        with torch.no_grad():
            rows = theirs(ids[:, start:stop], cache)[..., ::16].long()
        got = nc.compute_ngram_ids(ours.layout, ids[:, start:stop], ngram_context=context)
        assert torch.equal(got, rows)
        context = cache.get_conv_state(2, 2).clone()  # the cache rolls it in place


@pytest.mark.gpu
@pytest.mark.parametrize("placement, prefetch", [("pinned", None), ("pinned", False),
                                                 ("gpu", None)])
def test_cuda_model(placement, prefetch):
    """On the GPU: ids and rows on torch's stream (pinned: over UVA, gathered ahead during the
    decoder layer before), bitwise transformers' tokens and logits."""
    reference = tiny_model(torch.bfloat16).to("cuda")
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched, placement=placement, prefetch=prefetch)
    ids = prompts(batch=3).cuda()
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    assert_same_generation(reference, patched, ids, attention_mask=mask, do_sample=False)


# ---- bad input: refused before anything is replaced ----

def unchanged(model) -> bool:
    return not any(isinstance(m, CachedNGramEmbedding) for m in model.modules())


def test_model_without_ngram_embedding():
    with pytest.raises(ValueError, match="Qwen4ExpForCausalLM has no Qwen4ExpTextNGramEmbedding"):
        use_ngram_cupy(Qwen4ExpForCausalLM(tiny_config(ple_layer_ids=[])))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        use_ngram_cupy("model")


def test_checkpoint_buffers_disagree(tmp_path, float32_pair):
    reference, _ = float32_pair
    state = {k: v.clone() for k, v in reference.state_dict().items() if "ple_embedding" in k}
    state[f"{NAMES[1]}.layer_multipliers"][1] += 2
    save_file(state, tmp_path / "bad.safetensors")
    model = copy.deepcopy(reference)
    with pytest.raises(ValueError, match="layer_multipliers differs"):
        use_ngram_cupy(model, checkpoint=tmp_path / "bad.safetensors")
    assert unchanged(model)


def test_checkpoint_shapes_disagree(tmp_path, float32_pair):
    reference, _ = float32_pair
    other = tiny_model(ple_embed_dim=32)
    other.save_pretrained(tmp_path / "other")
    model = copy.deepcopy(reference)
    with pytest.raises(ValueError, match="shape"):
        use_ngram_cupy(model, checkpoint=tmp_path / "other")
    assert unchanged(model)


def test_table_dtype_the_config_does_not_name(tmp_path):
    model = tiny_model(ple_embedding_dtype="bfloat16")
    fp8_checkpoint(model, tmp_path / "fp8")
    with pytest.raises(ValueError, match="ple_embedding_dtype='bfloat16'"):
        use_ngram_cupy(model, checkpoint=tmp_path / "fp8")
    with pytest.raises(ValueError, match="ple_embedding_dtype='bfloat16'"):
        use_ngram_cupy(model, weight_dtype=torch.float32)
    assert unchanged(model)


def test_bad_arguments(tmp_path, float32_pair):
    reference, _ = float32_pair
    model = copy.deepcopy(reference)
    fp8_checkpoint(model, tmp_path / "fp8")
    with pytest.raises(TypeError, match="weight_dtype must be one of"):
        use_ngram_cupy(model, weight_dtype=torch.int8)
    with pytest.raises(ValueError, match="Qwen4Exp tables are not quantised to mxfp8"):
        use_ngram_cupy(model, weight_dtype="mxfp8")
    with pytest.raises(ValueError, match="weight_dtype=torch.bfloat16 but"):
        use_ngram_cupy(model, checkpoint=tmp_path / "fp8", weight_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="unexpected table option"):
        use_ngram_cupy(model, fused=True)
    with pytest.raises(ValueError, match="hot_rows keys"):
        use_ngram_cupy(model, hot_rows={"model.layers.1": [1]})
    with pytest.raises(ValueError, match="placement"):
        use_ngram_cupy(model, placement="disk")
    with pytest.raises(ValueError, match="mmap"):
        use_ngram_cupy(model, placement="mmap")
    meta = copy.deepcopy(reference)
    meta.get_submodule(NAMES[0]).ngram_embedding.to("meta")
    with pytest.raises(ValueError, match="meta device: pass checkpoint="):
        use_ngram_cupy(meta)
    assert unchanged(model) and unchanged(meta)


def test_the_layer_takes_every_release_call(float32_pair):
    """transformers 5.25 calls ``ple_embedding(input_ids, cache, **kwargs)`` with the model's
    keyword arguments; 5.23 passes ``past_key_values``: each form, prefill then decode through
    a cache, gives transformers' own layer's rows and cache."""
    reference, patched = float32_pair
    theirs, ours = reference.get_submodule(NAMES[1]), patched.get_submodule(NAMES[1])
    ids = prompts(batch=2, length=6, seed=7)
    calls = [lambda x, c: ours(x, c, output_router_logits=False, use_cache=True,
                               position_ids=None),
             lambda x, c: ours(x, cache=c, output_attentions=False),
             lambda x, c: ours(x, past_key_values=c)]
    caches = [DynamicCache(config=reference.config) for _ in range(len(calls) + 1)]
    for start, stop in ((0, 5), (5, 6)):
        chunk = ids[:, start:stop]
        with torch.no_grad():
            want = theirs(chunk, caches[0])
            for call, cache in zip(calls, caches[1:], strict=True):
                assert torch.equal(call(chunk, cache), want)
    for cache in caches[1:]:
        assert torch.equal(cache.get_conv_state(2, 2), caches[0].get_conv_state(2, 2))
    with pytest.raises(TypeError, match="cache= or past_key_values="):
        ours(ids, caches[1], past_key_values=caches[2])


def test_prefetch_hook_finds_the_cache_under_either_name(float32_pair):
    """The decoder layer before a PLE layer is called with ``cache=`` (5.25) or
    ``past_key_values=`` (5.23): its prefetch hook reads the context from either."""
    reference, _ = float32_pair
    model = copy.deepcopy(reference)
    use_ngram_cupy(model, placement="cpu", prefetch=True)
    ours = model.get_submodule(NAMES[1])
    ids = prompts(batch=2, length=6, seed=8)
    cache = DynamicCache(config=reference.config)
    with torch.no_grad():
        ours(ids[:, :5], cache=cache)
    hook = next(iter(model.get_submodule("model.layers.1")._forward_pre_hooks.values()))
    for name in ("cache", "past_key_values"):
        hook(None, (), {"ple_input_ids": ids[:, 5:], name: cache})
        want = nc.compute_ngram_ids(ours.layout, ids[:, 5:],
                                    ngram_context=cache.get_conv_state(2, 2)).view(-1, 4)
        assert torch.equal(ours.step.prefetched, ours.table.lookup(want))


def test_releases_outside_the_tested_range(monkeypatch, float32_pair):
    """A newer release warns once, naming the tested range; a release whose layer lost what
    is replaced is refused, naming the release, before any module changes."""
    reference, _ = float32_pair
    import ngram_cupy.transformers as integration  # the transformers module it reads
    monkeypatch.setattr(integration.transformers, "__version__", "5.99.0")
    integration.check_release.cache_clear()
    with pytest.warns(UserWarning, match=r"transformers 5\.99\.0 is newer .*5\.23 to 5\.25"):
        use_ngram_cupy(copy.deepcopy(reference), placement="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        use_ngram_cupy(copy.deepcopy(reference), placement="cpu")  # once per release

    def forward(self, hidden_states, position_ids):
        return hidden_states

    monkeypatch.setattr(integration.transformers, "__version__", "6.0.0")
    monkeypatch.setattr(integration.Qwen4ExpTextNGramEmbedding, "forward", forward)
    integration.check_release.cache_clear()
    model = copy.deepcopy(reference)
    with pytest.warns(UserWarning), pytest.raises(
            RuntimeError, match=r"transformers 6\.0\.0's Qwen4ExpTextNGramEmbedding .*"
                                r"\(hidden_states, position_ids\).*5\.23 to 5\.25"):
        use_ngram_cupy(model)
    assert unchanged(model)
    monkeypatch.undo()
    monkeypatch.setattr(integration.transformers, "__version__", "5.17.0")
    integration.check_release.cache_clear()
    with pytest.raises(RuntimeError, match=r"transformers 5\.17\.0 is older .*5\.23 to 5\.25"):
        use_ngram_cupy(model)
    assert unchanged(model)
    monkeypatch.undo()
    integration.check_release.cache_clear()
    model = copy.deepcopy(reference)
    monkeypatch.delattr(model.get_submodule(NAMES[0]), "ple_layer_index")
    with pytest.raises(RuntimeError, match=rf"{NAMES[0]} lacks ple_layer_index"):
        use_ngram_cupy(model)
    assert unchanged(model)
