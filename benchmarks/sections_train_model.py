"""A model trained end to end: transformers' tiny Qwen4Exp (the tests' configuration, float32)
trained on the sample corpus twice, on the same batches from the same seed: (a) its own
``nn.Embedding`` PLE tables, (b) this library's tables through ``use_ngram_cupy`` with fused,
asynchronous SGD and prefetch. Both arms use SGD everywhere, so their losses must agree."""

from __future__ import annotations

import os
import time

import numpy as np

from .report import Row, Section
from .sections_transformers import tiny_config

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "python_stdlib.parquet")
VOCAB, RESERVED = 512, 3  # the tiny model's vocabulary; ids 0-2 are pad, unused and EOS
BATCH, LENGTH, LR = 4, 64, 0.2
PLE_NAMES = ("model.layers.0.ple.ple_embedding", "model.layers.2.ple.ple_embedding")


def corpus_batches(steps: int, batch: int = BATCH, length: int = LENGTH) -> list:
    """``steps`` int64 torch batches ``[batch, length]`` of consecutive corpus tokens (the stored
    Qwen3.5 tokens, the tests' tokenizer), mapped into the tiny vocabulary as ``3 + token % 509``
    (0-2 stay pad / unused / EOS)."""
    import pyarrow.parquet as pq
    import torch

    column = pq.read_table(CORPUS, columns=["tokens"]).column("tokens").combine_chunks()
    tokens = column.values.to_numpy().astype(np.int64)
    need = steps * batch * length
    mapped = RESERVED + tokens[:need] % (VOCAB - RESERVED)
    return [torch.from_numpy(part.reshape(batch, length).copy())
            for part in np.split(mapped, steps)]


def fresh_model():
    """The tests' tiny model from seed 0, its PLE tables drawn N(0, 1) as the tests draw them."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(tiny_config()).eval()  # eval: no dropout, the same bits per arm
    with torch.no_grad():
        for name in PLE_NAMES:
            model.get_submodule(name).ngram_embedding.weight.normal_(0.0, 1.0)
    return model


def arms(lr: float = LR):
    """``[(model, dense optimizer, finish)]`` for arm (a), nn.Embedding tables under torch SGD,
    and arm (b), ngram_cupy tables with fused asynchronous SGD (``finish`` waits for it)."""
    import torch

    from ngram_cupy.transformers import use_ngram_cupy

    plain = fresh_model()
    ours = fresh_model()
    use_ngram_cupy(ours, placement="cpu", trainable=True, optimizer="sgd", prefetch=True,
                   optimizer_options={"lr": lr, "asynchronous": True})
    fused = [ours.get_submodule(name).trainable_rows.optimizer for name in PLE_NAMES]

    def synchronize() -> None:
        for optimizer in fused:
            optimizer.synchronize()

    return [(plain, torch.optim.SGD(plain.parameters(), lr=lr), lambda: None),
            (ours, torch.optim.SGD(ours.parameters(), lr=lr), synchronize)]


def train_step(model, optimizer, ids) -> float:
    """One SGD step on the language-model loss; the loss."""
    optimizer.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def train_both(steps: int, lr: float = LR):
    """Both arms in lockstep on the same batches (each step timed, the arms' order alternating
    so that both see the same load): losses ``[2, steps]`` and seconds ``[2, steps]``."""
    losses, seconds = np.zeros((2, steps)), np.zeros((2, steps))
    both = arms(lr)
    for step, ids in enumerate(corpus_batches(steps)):
        for arm in ((0, 1) if step % 2 == 0 else (1, 0)):
            model, optimizer, finish = both[arm]
            began = time.perf_counter()
            losses[arm, step] = train_step(model, optimizer, ids)
            if step == steps - 1:
                finish()  # the last update, inside the last step's time
            seconds[arm, step] = time.perf_counter() - began
    return losses, seconds


def plot_losses(losses: np.ndarray, path: str) -> bool:
    """The two arms' loss curves as a PNG (matplotlib; False without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from ngram_cupy.runtime.atomic import atomic_file

    fig, (curves, gap) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = np.arange(1, losses.shape[1] + 1)
    curves.plot(steps, losses[0], label="(a) nn.Embedding PLE tables, torch SGD")
    curves.plot(steps, losses[1], linestyle="--",
                label="(b) ngram_cupy tables, fused asynchronous SGD")
    curves.set(xlabel="step", ylabel="loss", title="tiny Qwen4Exp on data/python_stdlib")
    curves.legend(fontsize="small")
    curves.grid(True, alpha=0.3)
    gap.plot(steps, np.abs(losses[1] - losses[0]) / losses[0])
    gap.axhline(1e-5, color="red", linestyle="--", linewidth=0.8, label="1e-5")
    gap.set(yscale="log", xlabel="step", ylabel="|b - a| / a", title="relative loss difference")
    gap.legend(fontsize="small")
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True


def bench_train_model(quick: bool) -> Section:
    """200 steps (quick: 40) of 4 x 64 tokens, lr 0.2; torch on one thread (2-core machine)."""
    import torch

    steps = 40 if quick else 200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses, seconds = train_both(steps)
    finally:
        torch.set_num_threads(threads)
    section = Section(f"a model trained end to end: tiny Qwen4Exp (float32), {steps} SGD steps "
                      f"of {BATCH} x {LENGTH} corpus tokens, lr {LR}", "cpu")
    section.curves = losses  # plotted beside the report as <name>-losses.png
    relative = np.abs(losses[1] - losses[0]) / losses[0]
    ratio = float(np.median(seconds[1] / seconds[0]))
    total = float(seconds[1].sum() / seconds[0].sum())
    section.rows.append(Row(case="(a) nn.Embedding PLE tables, torch SGD",
                            seconds=float(np.median(seconds[0])),
                            notes=f"loss {losses[0, 0]:.4f} -> {losses[0, -1]:.4f}"))
    section.rows.append(Row(case="(b) ngram_cupy tables, fused asynchronous SGD, prefetch",
                            seconds=float(np.median(seconds[1])),
                            notes=f"loss {losses[1, 0]:.4f} -> {losses[1, -1]:.4f}; "
                                  f"step time (b) / (a): {ratio:.3f} (median of per-step "
                                  f"ratios; whole run {total:.3f}; target <= 1.05)"))
    over = np.flatnonzero(relative > 1e-5)
    within = int(over[0]) if over.size else steps
    section.rows.append(Row(case="loss difference", seconds=0.0,
                            notes=f"within 1e-5 relative for the first {within} steps "
                                  f"(largest {relative[:within].max():.1e}); final abs(b - a) = "
                                  f"{abs(losses[1, -1] - losses[0, -1]):.2e} "
                                  f"({relative[-1]:.1e} relative), largest over the run "
                                  f"{relative.max():.1e} (target 1e-5 at every step)"))
    return section
