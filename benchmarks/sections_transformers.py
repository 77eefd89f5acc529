"""transformers' Qwen4Exp with and without ngram_cupy tables, on the CPU: host memory and speed.

Memory: one PLE layer of a tiny model scaled up to a table of at least 1 GiB in bf16, each case
in a fresh process (``python -m benchmarks.sections_transformers CASE FOLDER``) that reports the
growth of its resident set (RSS) past the imports: transformers building its bf16 table, and
``use_ngram_cupy`` reading an fp8 or bf16 checkpoint into a model whose table is on the meta
device. Speed: one PLE layer's forward, and ``generate`` on the tiny test model, paired rounds
with and without.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from .report import Row, Section
from .timers import paired, timeit

GIB = 1 << 30
MEMORY_CASES = ("transformers bf16", "ngram_cupy bf16", "ngram_cupy fp8", "ngram_cupy nvfp4")


def tiny_config(**overrides):
    """The tiny Qwen4Exp of tests/faces/test_transformers.py (4 layers, hidden 64)."""
    from transformers import Qwen4ExpTextConfig

    values = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, hc_count=2,
        hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=64, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=16, split_ngram_parts=4,
        eos_token_id=2, pad_token_id=0, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
    values.update(overrides)
    return Qwen4ExpTextConfig(**values)


def big_table_config(quick: bool, decoder_layer: int = 1):
    """One PLE layer (on ``decoder_layer``, one-indexed) of 4 heads x 16 values: about 36 M
    rows, a 1.07 GiB bf16 table (quick: a quarter)."""
    return tiny_config(ple_layer_ids=[decoder_layer],
                       ngram_vocab_size_base=2_250_000 if quick else 9_000_000,
                       split_ngram_parts=64)


def table_prefix(config) -> str:
    """The module name (and checkpoint prefix) of the config's one PLE layer."""
    return f"model.layers.{config.ple_layer_ids[0] - 1}.ple.ple_embedding"


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set now (``VmHWM``: its peak, which, unlike ``ru_maxrss``, a
    process started from a larger one does not inherit)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def write_checkpoints(hf_config, folder: str) -> int:
    """The big layer's table in fp8 (with a scale), bf16 and NVFP4 (vLLM's names), as three
    checkpoints in ``folder``; returns the table's rows."""
    import ngram_cupy as nc
    from ngram_cupy.files.checkpoint_writing import ngram_tensors
    from ngram_cupy.files.safetensors_files import write_checkpoint
    from ngram_cupy.transformers import ngram_config

    layout = nc.layer_layout(ngram_config(hf_config), 0)
    prefix = table_prefix(hf_config)
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, (layout.padded_rows, layout.head_dim), np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # no NaN
    fp8 = bits.view(ml_dtypes.float8_e4m3fn)
    write_checkpoint(os.path.join(folder, "fp8"), ngram_tensors(
        layout, fp8, np.array(0.5, ml_dtypes.bfloat16), prefix=prefix), 4)
    bf16 = (bits.astype(np.uint16) | 0x3C00).view(ml_dtypes.bfloat16)  # finite, varied values
    packed = np.ascontiguousarray(bits[:, : layout.head_dim // 2])  # E2M1 code pairs
    block_scales = np.full((layout.padded_rows, layout.head_dim // 16), 0x38, np.uint8)  # 1.0
    del fp8, bits
    write_checkpoint(os.path.join(folder, "bf16"), ngram_tensors(layout, bf16, prefix=prefix), 4)
    del bf16
    write_checkpoint(os.path.join(folder, "nvfp4"), ngram_tensors(
        layout, packed, np.float32(0.5), prefix=prefix, block_scales=block_scales), 4)
    return layout.padded_rows


def measure_case(case: str, folder: str, quick: bool) -> dict:
    """In this process: RSS growth (and peak) past the imports for one memory case."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    from ngram_cupy.transformers import use_ngram_cupy

    config = big_table_config(quick)
    torch.set_default_dtype(torch.bfloat16)
    before, start = rss_bytes(), time.perf_counter()
    if case == "transformers bf16":
        model = Qwen4ExpForCausalLM(config)
    else:
        with torch.device("meta"):
            model = Qwen4ExpForCausalLM(config)
        model.to_empty(device="cpu")  # uninitialised: only the table's pages would count
        model.get_submodule(table_prefix(config)).to("meta")  # the table as from a meta load
        use_ngram_cupy(model, checkpoint=os.path.join(folder, case.split()[-1]),
                       placement="cpu")
    seconds = time.perf_counter() - start
    return {"rss": rss_bytes() - before, "peak": rss_bytes("VmHWM") - before,
            "seconds": seconds}


def bench_memory(quick: bool) -> list[Row]:
    """One fresh process per memory case; rows of RSS growth against transformers' bf16."""
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as folder:
        table_rows = write_checkpoints(big_table_config(quick), folder)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        for case in MEMORY_CASES:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.sections_transformers", case, folder,
                 "quick" if quick else "full"], capture_output=True, text=True, cwd=root,
                env=env, check=True)
            results[case] = json.loads(done.stdout.splitlines()[-1])
    base = results["transformers bf16"]["rss"]
    for case in MEMORY_CASES:
        got = results[case]
        rows.append(Row(
            case=f"{case}: RSS past imports, {table_rows:,} x 16 rows",
            seconds=got["seconds"], rate=f"{got['rss'] / GIB:.3f} GiB",
            notes=f"{got['rss'] / base:.2f}x transformers' bf16 table; peak "
                  f"{got['peak'] / GIB:.3f} GiB; time = building / loading the model"))
    return rows


def bench_generate(quick: bool) -> list[Row]:
    """Greedy ``generate`` of the tiny model, paired rounds with and without ngram_cupy."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    from ngram_cupy.transformers import use_ngram_cupy

    torch.manual_seed(0)
    reference = Qwen4ExpForCausalLM(tiny_config()).eval()
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched)
    prompt = torch.randint(3, 512, (1, 32), generator=torch.Generator().manual_seed(1))
    new = 16 if quick else 32
    rounds = 5 if quick else 21

    def run(model):
        return lambda: model.generate(prompt, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, pad_token_id=0)

    assert torch.equal(run(reference)(), run(patched)())
    with torch.no_grad():
        ours, theirs, ratio = paired(run(patched), run(reference), min_time=1.0, rounds=rounds)
    return [Row(case=f"generate, 1 x 32 prompt + {new} tokens, {name}", seconds=seconds,
                rate=f"{new / seconds:.1f} token/s", notes=notes)
            for name, seconds, notes in (
                ("transformers", theirs, "baseline"),
                ("ngram_cupy (pinned -> host memory, float32)", ours,
                 f"{ratio:.3f}x transformers' time (median of paired rounds)"))]


def bench_layer(quick: bool) -> list[Row]:
    """One PLE layer's forward alone (ids and rows, no cache), paired rounds: the part that
    differs, timed without the rest of the model's noise."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    from ngram_cupy.transformers import use_ngram_cupy

    torch.manual_seed(0)
    reference = Qwen4ExpForCausalLM(tiny_config()).eval()
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched)
    name = "model.layers.0.ple.ple_embedding"
    theirs, ours = reference.get_submodule(name), patched.get_submodule(name)
    rows = []
    for shape in ((1, 1), (32, 1), (1, 512)):
        ids = torch.randint(3, 512, shape, generator=torch.Generator().manual_seed(2))
        assert torch.equal(ours(ids, None), theirs(ids, None))
        with torch.no_grad():
            mine, base, ratio = paired(lambda i=ids: ours(i, None), lambda i=ids: theirs(i, None),
                                       min_time=0.5 if quick else 2.0)
        tokens = shape[0] * shape[1]
        rows += [Row(case=f"PLE layer forward, [{shape[0]}, {shape[1]}] ids, transformers",
                     seconds=base, rate=f"{tokens / base / 1e3:.1f} ktoken/s", notes="baseline"),
                 Row(case=f"PLE layer forward, [{shape[0]}, {shape[1]}] ids, ngram_cupy",
                     seconds=mine, rate=f"{tokens / mine / 1e3:.1f} ktoken/s",
                     notes=f"{ratio:.3f}x transformers' time (median of paired rounds)")]
    return rows


def without_transformers(section: Section) -> Section | None:
    """``section`` saying why it did not run when transformers is not installed (the GPU
    machines have no package index), else None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        section.rows.append(Row(case="not run: transformers is not installed (pip install "
                                "'ngram-cupy[transformers]')", seconds=0.0))
        return section
    return None


def bench_transformers_cpu(quick: bool) -> Section:
    """Both parts as one section."""
    section = Section("transformers Qwen4Exp, CPU: PLE table host memory (fresh process per "
                      "case) and generate speed", "cpu")
    if (skipped := without_transformers(section)) is not None:
        return skipped
    section.rows = bench_memory(quick) + bench_layer(quick) + bench_generate(quick)
    return section


def bench_transformers_gpu(quick: bool) -> Section:
    """``generate`` of a bf16 model on the GPU: transformers' table in GPU memory, then the
    same model with a pinned fp8 table read over PCIe, with and without prefetch (the PLE
    layer on decoder layer 3, so the gather overlaps layer 2)."""
    section = Section("transformers Qwen4Exp, GPU: generate, bf16 model, one PLE layer whose "
                      "table is >= 1 GiB in bf16", "gpu")
    if (skipped := without_transformers(section)) is not None:
        return skipped
    import torch
    from transformers import Qwen4ExpForCausalLM

    from ngram_cupy.transformers import use_ngram_cupy

    config = big_table_config(quick, decoder_layer=3)
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(config).to("cuda", torch.bfloat16).eval()
    batch, new = (8, 16) if quick else (32, 32)
    prompt = torch.randint(3, 512, (batch, 64), device="cuda")

    def run():
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()

    def row(case: str, notes: str) -> Row:
        seconds = timeit(run, min_time=2.0 if quick else 10.0, max_calls=50)
        return Row(case=case, seconds=seconds, rate=f"{batch * new / seconds:,.0f} token/s",
                   notes=notes)

    with torch.no_grad():
        section.rows.append(row("transformers: bf16 table in GPU memory", "baseline"))
        base = section.rows[0].seconds
        with tempfile.TemporaryDirectory() as folder:
            write_checkpoints(config, folder)
            use_ngram_cupy(model, checkpoint=os.path.join(folder, "fp8"), placement="pinned")
        layer = model.get_submodule(table_prefix(config))
        for prefetch in (None, False):
            layer.prefetch = prefetch
            got = row(f"ngram_cupy: pinned fp8 table, prefetch "
                      f"{'on' if prefetch is None else 'off'}", "")
            got.notes = f"{got.seconds / base:.3f}x transformers' time"
            section.rows.append(got)
    return section


if __name__ == "__main__":  # one memory case in this fresh process: JSON on the last line
    print(json.dumps(measure_case(sys.argv[1], sys.argv[2], sys.argv[3] == "quick")))
