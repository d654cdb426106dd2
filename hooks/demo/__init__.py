"""``python -m diag demo``: a small character-level GPT trained on the CPU, monitored live.

The data is the Python standard library's own source (the ``.py`` files beside
the ``os`` module, in sorted order, the first ~2 MB), so the demo needs no
download. The model is nanoGPT-style and pre-LN, with few wide heads (d_head 64)
and context 128.

The default is a constant learning rate of 5e-3 with no warmup: the first AdamW
steps are as large as the initial weights, sigma_1(Wq^T Wk) runs away with its
energy in one direction, the loss stalls near the unigram level, and heads of
the first layer turn sparse yet low-rank (most queries point at the same few
keys). ``--warmup 100`` is the healthy twin; ``--step-limit 0.03`` the remedy
without warmup (:class:`hooks.SpectralStepLimit`). Compare them in one TensorBoard::

    python -m diag demo --logdir runs/demo
    python -m diag demo --warmup 100 --logdir runs/demo-warmup
    python -m tensorboard.main --logdir runs

The Monitor is attached exactly as in any training loop. The package is also the
examples', the benchmarks' and the evaluation's model, data and loop: ``model``
(``GPTConfig``, ``GPT``, its ``SelfAttention`` and ``Block``), ``data`` (``load_text``,
``encode``, ``get_batch``), ``loop`` (``train_steps``, the one training loop, with its
``Schedule``), ``run`` (the demo's run: ``DemoRun``, ``train``, ``run_demo``).
"""

from hooks.demo.data import MAX_CHARS, encode, get_batch, load_text
from hooks.demo.loop import Schedule, StepCallback, adamw, train_steps
from hooks.demo.model import GPT, Block, GPTConfig, SelfAttention
from hooks.demo.run import DEFAULT_LR, DemoRun, run_demo, train

__all__ = ["DEFAULT_LR", "Block", "DemoRun", "GPT", "GPTConfig", "MAX_CHARS", "Schedule", "SelfAttention",
           "StepCallback", "adamw", "encode", "get_batch", "load_text", "run_demo", "train", "train_steps"]
