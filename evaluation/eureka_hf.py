"""The Eureka task on a second implementation: Hugging Face's ViT, built from a config, on the same digit grids.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.runs vit --model hfvit --seed 0 --lr 1.2e-3 --steps 2500 \\
        --out RUNS_DIR
    (add --normsoftmax for the NormSoftmax twin)

The data is :mod:`evaluation.eureka`'s (:class:`evaluation.eureka.DigitGrid`: the 2x2 grid of scikit-learn
digits whose top-left digit names the label cell), with two candidate cells instead of three (the plateau is
"one of two digits", lower against the first loss), and so are the held-out evaluation and the no-indicator
accuracy. What differs is everything the model and its training bring: ``transformers.ViTForImageClassification``
(its own patch convolution, separate ``q_proj``/``k_proj``/``v_proj`` with biases, GELU MLPs, its own
initialisation and ``sdpa`` attention) at 2 layers of 4 heads, width 128 (d_head 32, against
:mod:`evaluation.eureka`'s width 64, d_head 16), batch 64 against 128, AdamW with betas 0.9/0.95 and weight
decay 0.1 (:func:`hooks.demo.adamw`) against torch's defaults. Trained by the shared loop
(:func:`hooks.demo.train_steps`) and recorded like every evaluation run (:mod:`evaluation.recording`).

NormSoftmax (``--normsoftmax``) replaces each layer's attention by :class:`NormSoftmaxAttention` (the logits
divided by their standard deviation over the keys, temperature 0.5 as :mod:`evaluation.eureka`'s), whose fused
attention call the Monitor reads: the twin's attention entropy is the NormSoftmax attention the model computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from transformers.models.vit.modeling_vit import ViTAttention

from diag.layouts import QKVLayout
from diag.outputs.sinks import MemorySink
from evaluation.eureka import DigitGrid, EurekaConfig, EurekaRun, Evaluation, blind_accuracy
from evaluation.recording import recording
from evaluation.spec import RunSpec
from hooks.demo import adamw, train_steps
from hooks.monitor.monitor import Monitor

__all__ = ["GridViT", "NormSoftmaxAttention", "SHAPE", "train_spec"]

SHAPE = {"n_layer": 2, "n_head": 4, "n_embd": 128, "patch": 4}  # the shape when the RunSpec names none
BATCH = 64
# the indicator's class mod 2 names the label cell (top-right or bottom-left; the bottom-right digit a distractor):
# the plateau before the indicator is read is "one of two digits", about 0.4 of the first loss, where
# evaluation.eureka's three candidates put it at about 0.55
CANDIDATES = 2


class NormSoftmaxAttention(ViTAttention):
    """Hugging Face's ViT attention with NormSoftmax over every key (no mask: a ViT): ``softmax(s / (T *
    std_keys(s)))`` with ``s = q.k * scale``, computed as one ``scaled_dot_product_attention`` call on the queries
    divided by ``T * std`` (each query's logits scaled by its own factor: the same softmax), so the Monitor reads
    the attention the model computes (its config stays ``sdpa``)."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        logits = (q @ k.transpose(-1, -2)) * self.scaling  # (B, H, T, T): only for their spread over the keys
        factor = EurekaConfig.temperature * logits.std(dim=-1, keepdim=True) + 1e-6  # (B, H, T, 1)
        out = F.scaled_dot_product_attention(q / factor, k, v, scale=self.scaling)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


class GridViT(nn.Module):
    """``ViTForImageClassification`` over the 16x16 grid as a one-channel image; ``forward(grid)`` -> logits."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, patch: int, attention: str) -> None:
        super().__init__()
        cfg = transformers.ViTConfig(image_size=16, patch_size=patch, num_channels=1, num_labels=10,
                                     hidden_size=n_embd, num_hidden_layers=n_layer, num_attention_heads=n_head,
                                     intermediate_size=4 * n_embd, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "sdpa"
        self.vit = transformers.ViTForImageClassification(cfg)
        if attention == "normsoftmax":  # the same initial weights, NormSoftmax attention
            for layer in self.vit.vit.layers:
                twin = NormSoftmaxAttention(cfg)
                twin.load_state_dict(layer.attention.state_dict())
                layer.attention = twin

    def forward(self, grid: Tensor) -> Tensor:
        return self.vit(pixel_values=grid[:, None]).logits  # grid (B, 16, 16) -> (B, 10)


def layouts(model: GridViT) -> dict[str, QKVLayout] | None:
    """The NormSoftmax twin's layout for the Monitor: Hugging Face's ViT projections, with the check of the
    kernel's q against them off (:class:`NormSoftmaxAttention` hands the kernel its queries rescaled); None for
    softmax attention (discovered)."""
    layer = model.vit.vit.layers[0].attention
    if not isinstance(layer, NormSoftmaxAttention):
        return None
    return {"vit.vit.layers.*.attention": QKVLayout(layer.num_attention_heads, layer.head_dim, q="q_proj.weight",
                                                    k="k_proj.weight", v="v_proj.weight", o="o_proj.weight",
                                                    verify=False)}


def train(cfg: EurekaConfig, batch: int = BATCH, observations=None, schedule=None) -> EurekaRun:
    """One run of the task on :class:`GridViT` with the Monitor attached (``cfg.every``), recorded into
    ``observations``; ``cfg``'s shape, learning rate, steps and attention are the run's."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    data = DigitGrid(candidates=CANDIDATES)
    model = GridViT(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.patch, cfg.attention)
    optimizer = adamw(model, cfg.lr)
    memory = MemorySink()
    monitor = Monitor(model, every=cfg.every, sinks=[memory], alerts=cfg.alerts, spec=layouts(model))
    evaluate = Evaluation(cfg, model, data, monitor, None)
    with recording(monitor, observations):
        kwargs = {} if schedule is None else {"schedule": schedule}
        losses = train_steps(model, lambda: data.batch(batch, gen),
                             lambda b: F.cross_entropy(model(b[0]), b[1]), optimizer, cfg.steps,
                             monitor=monitor, callbacks=(evaluate,), **kwargs)
    return EurekaRun(cfg, monitor, memory, losses, evaluate.evals)


def train_spec(spec: RunSpec, out) -> dict:
    """A ``RunSpec(task="vit", model="hfvit")``: train it, recorded into ``out``; returns what
    :func:`evaluation.eureka.train_spec` returns (the every-step losses, the held-out evaluations, the
    no-indicator accuracy)."""
    if spec.twin not in ("", "normsoftmax"):
        raise ValueError(f"RunSpec(model='hfvit', twin={spec.twin!r}): the Hugging Face ViT of the Eureka task has "
                         "a NormSoftmax twin only; leave the twin out or take --normsoftmax")
    shape = {**SHAPE, **spec.shape}
    cfg = EurekaConfig(attention=spec.twin or "softmax", seed=spec.seed, steps=spec.steps, lr=spec.lr,
                       every=spec.every or 10, **shape)
    run = train(cfg, observations=out / "observations.jsonl", schedule=spec.lr_schedule)
    return {"losses": run.losses, "evals": run.evals, "blind": blind_accuracy(DigitGrid(candidates=CANDIDATES))}
