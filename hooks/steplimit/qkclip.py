"""QK-clip (Kimi K2's MuonClip) for any transformer: per head, grouped-query aware, from the model as it is.

    clip = QKClip(model, tau=100.0, optimizer=optimizer)   # clips after every optimizer.step()

After each optimizer step where query head h's largest pre-softmax logit ``S_h`` on that step's batch exceeded
``tau``, the head's query and key projections are scaled so that its logits scale by ``f_h = tau / S_h``:
``f^alpha`` on W_Q and ``f^(1 - alpha)`` on W_K (``alpha = 0.5``: ``sqrt(f)`` on each), biases with their
weights. ``S_h`` is measured, not assumed: :class:`hooks.steplimit.maxlogit.MaxLogits` reads every attention call
of the training forwards since the last step (SDPA, eager softmax, ``nn.MultiheadAttention``) for the per-head
maximum over the whole batch.

Grouped-query and multi-query attention: key head g is shared by the query heads of its group, so it is scaled
once, by ``k_g = (max over the group of f_h)^(1 - alpha)``, and each query head of the group by ``f_h / k_g``
(never above 1, since ``f_h <= max f <= (max f)^(1 - alpha)``): every head's logits scale by exactly ``f_h``,
none by more than it needs, and no query weight grows. A group with one head under ``tau`` keeps its keys.

The heads' rows are found through the layer's ``QKVLayout`` and its packing (separate, fused, GPT-2's transposed
Conv1D, per head, per group, ``q_kv``, 3-D per-head weights): the packing's split of an index tensor gives the
elements of each head, and only those are written, in place, under ``no_grad``. Rotary embeddings (full or
partial) rotate q and k after the projection, linearly, so scaling W_Q and W_K scales the rotated q and k alike.
A layer that normalises q and k (QK-norm: ``q_norm``/``k_norm`` modules, as OLMo2 and Qwen3 have) is refused at
construction: scaling W_Q or W_K does not change its logits, which its norm gains bound instead.

A healthy step (no head above ``tau``) writes nothing: parameters and optimizer state stay bit for bit those of
the run without QKClip, and no random number is drawn. One host transfer per clipping step (the maxima).

Several processes: the ranks that see other parts of the batch (DDP replicas, FSDP2's ranks, a 2-D mesh's data
dim) and the ranks that hold other heads (tensor parallelism, whose ranks share one batch) are all covered by one
``all_reduce`` (MAX, float64) over every rank per clipping step, of every layer's per-head maxima at the global
head numbers (-inf where a rank holds or read nothing): afterwards every rank holds each head's largest logit over
the global batch, computes the same factors, and logs every head as one process would. Each rank then scales
the elements it holds of the clipped heads: a head's elements are found on the full shape, as above, and those
inside the rank's block of a DTensor (``to_local()``, its global offset) are written: FSDP2's row shards (uneven
ones included), tensor parallelism's blocks of whole heads (``ColwiseParallel``; the reader reads the rank's block
of heads from its kernel), both at once (TP x FSDP2), and HSDP's replicas alike. A mesh that does not span every
rank (pipeline stages holding other layers) is refused at construction.
See docs/steplimit.md#qk-clip.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from diag.catalog.alerts import ALERTS
from diag.catalog.tags import head_label
from diag.detectors.base import Alert
from diag.errors import ConfigError, WarnOnce
from diag.layouts.biases import biases_of
from diag.layouts.packings import packing_of
from hooks.capture.forwards import KERNELS, attn_implementation
from hooks.layout.discover import AttentionLayer, discover
from hooks.parallel.dtensors import is_dtensor, local_tensor
from hooks.steplimit.maxlogit import MaxLogits

__all__ = ["QKClip", "Intervention", "QK_NORMS", "QKCLIP_STATE_KEY"]

log = logging.getLogger("diag")

QKCLIP_STATE_KEY = "qk_clip"
# Child modules of an attention module that normalise q or k (QK-norm), by their last name
QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "norm_q",
            "norm_k", "q_ln", "k_ln", "ln_q", "ln_k")
_TRUSTED = ("given", "confirmed", "adopted")  # layout states whose head rows the clip writes (hooks/layout/record.py)


@dataclass(frozen=True)
class Intervention:
    """One head clipped at one step: its largest logit, the factor its logits were scaled by
    (``factor = tau / max_logit``), and how that factor was split between W_Q and W_K."""

    step: int
    layer: str  # the layer's tag label, e.g. "L03"
    head: int  # the query head
    max_logit: float
    factor: float
    q_factor: float
    k_factor: float  # the factor of its key head (shared by the query heads of its group)


class QKClip:
    """After each optimizer step, scales W_Q and W_K of every query head whose largest logit exceeded ``tau``.

    Args:
        model: the model; its attention layers are discovered as the Monitor does
            (``hooks.layout.discover.discover(model, spec)``), unless ``attention=`` or ``monitor=`` give them.
        tau: the bound on the largest pre-softmax logit of each head, > 0 (Kimi K2: 100).
        alpha: the share of the factor on the queries: ``f^alpha`` on W_Q, ``f^(1 - alpha)`` on W_K, in [0, 1].
        optimizer: a ``torch.optim.Optimizer`` whose every ``step()`` is followed by the clip (a step post
            hook); None: call :meth:`step` after ``optimizer.step()`` yourself.
        spec: module-name patterns -> ``QKVLayout`` for models discovery does not know.
        attention: the attention layers (``monitor.layers`` or ``discover(model)``); default: the monitor's,
            else discovered.
        exclude: fnmatch patterns on attention module names whose layers are not clipped.
        every: clip every this many steps (the maxima are read only in the forwards of those steps), >= 1.
        monitor: a ``hooks.Monitor``: each clipping step's heads are logged through ``monitor.log_scalars``
            and sent as one ``qk_clip`` info alert through its ``alert_sink``; on its sampled steps the
            largest logit of each layer is logged too.
    """

    def __init__(
        self,
        model: nn.Module,
        tau: float = 100.0,
        *,
        alpha: float = 0.5,
        optimizer: torch.optim.Optimizer | None = None,
        spec: Mapping | None = None,
        attention: Iterable[AttentionLayer] | None = None,
        exclude: Iterable[str] = (),
        every: int = 1,
        monitor: object | None = None,
    ) -> None:
        _check_args(model, tau, alpha, optimizer, every, monitor)
        self.model, self.tau, self.alpha, self.every, self.monitor = model, float(tau), float(alpha), every, monitor
        exclude = list(exclude)
        if attention is not None:
            layers = list(attention)
        elif monitor is not None:
            layers = list(monitor.layers)
        else:
            layers = discover(model, spec)
        self.layers = [layer for layer in layers if not any(fnmatch.fnmatchcase(layer.name, p) for p in exclude)]
        if not self.layers:
            raise ConfigError(f"QKClip(exclude={exclude!r}) leaves no attention layer of the "
                              f"{len(layers)} found; exclude only the layers that must not be clipped")
        for layer in self.layers:
            _check_layer(layer, monitor is not None)
        # every rank of a job (other parts of the batch, other heads): their maxima are reduced at each clipping
        # step, so that every rank clips its weights alike
        self._group = _reduce_group()
        self.step_count = 0  # calls of step()
        self.interventions: list[Intervention] = []
        self.n_interventions = 0  # every intervention of the run, across resumes
        self.last: dict[str, list[float]] = {}  # the latest clipping step's largest logit per head, by layer label
        self._warn = WarnOnce(log, stacklevel=3)
        self.reader = MaxLogits([layer.on_this_rank() for layer in self.layers], model)
        self._hook = None if optimizer is None else optimizer.register_step_post_hook(self._after_step)
        self._arm_for(self.step_count)

    def __repr__(self) -> str:
        return f"QKClip(tau={self.tau:g}, alpha={self.alpha:g}, layers={len(self.layers)})"

    # ------------------------------------------------------------------ the step

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.step()

    def step(self) -> list[Intervention]:
        """Clip the heads whose largest logit since the last step exceeded ``tau``; returns this step's
        interventions. Call it after ``optimizer.step()`` (done for you with ``optimizer=``)."""
        step = self.step_count
        maxima, problems = self.reader.take()
        done: list[Intervention] = []
        if self.reader.armed:
            for index, why in problems.items():
                self._warn(("problem", index), f"diag: QKClip could not read the attention of layer "
                           f"{self._label(index)} ({why}); that layer is not clipped")
            done = self._clip(step, maxima, problems)
        self.step_count += 1
        self._arm_for(self.step_count)
        return done

    def _arm_for(self, step: int) -> None:
        """The reader is armed during the forwards of the steps that clip."""
        if step % self.every == 0:
            self.reader.arm()
        else:
            self.reader.disarm()

    def _label(self, index: int) -> str:
        return next((layer.label for layer in self.layers if layer.index == index), str(index))

    def _clip(self, step: int, maxima: dict[int, Tensor], problems: dict[int, str]) -> list[Intervention]:
        if self._group is not None:
            maxima = self._reduce(maxima)
        read = [layer for layer in self.layers if layer.index in maxima]
        unread = [layer.name for layer in self.layers if layer.index not in maxima and layer.index not in problems]
        if unread:
            self._warn(("unread", tuple(unread)), f"diag: QKClip saw no attention call of {unread[:4]} since the "
                       "last step (no training forward: model.train() and grad enabled?); those layers are not "
                       "clipped at that step")
        if not read:
            return []
        host = torch.cat([maxima[layer.index].reshape(-1).cpu() for layer in read]).tolist()  # one transfer
        done: list[Intervention] = []
        at = 0
        self.last = {}
        for layer in read:
            n = layer.layout.n_heads
            values = host[at:at + n]
            at += n
            self.last[layer.label] = values
            if layer.record.state not in _TRUSTED:  # its heads' rows are not known for sure
                self._warn(("state", layer.index), f"diag: QKClip leaves layer {layer.label} ({layer.name!r}) as it "
                           f"is: its layout is {layer.record.state} ({layer.record.why or 'not yet confirmed'})")
                continue
            done += self._clip_layer(step, layer, values)
        self.interventions += done
        self.n_interventions += len(done)
        self._report(step, done)
        return done

    def _reduce(self, maxima: dict[int, Tensor]) -> dict[int, Tensor]:
        """Every layer's per-head maxima over the batches of every rank and over the heads of every rank, in one
        ``all_reduce`` (MAX, float64) over every rank, read to the host in one transfer. Per layer the buffer holds
        a flag (1: read on some rank, else -inf) and its H maxima at the global head numbers (-inf where this rank
        read nothing or holds other heads; NaN is sent as +inf, which is not clipped either). Returns the layers
        read on some rank, each with its (H,) maxima on the host."""
        sizes = [1 + layer.layout.n_heads for layer in self.layers]
        device = local_tensor(next(iter(self.layers[0].params().values()))).device
        buf = torch.full((sum(sizes),), -math.inf, dtype=torch.float64, device=device)
        at = 0
        for layer, n in zip(self.layers, sizes):
            got = maxima.get(layer.index)
            if got is not None:
                got = got.detach().reshape(-1).to(device, torch.float64)
                first = 0 if layer.block is None else layer.block.first_head  # tensor parallelism: this rank's heads
                buf[at] = 1.0
                buf[at + 1 + first:at + 1 + first + got.numel()] = torch.where(got.isnan(), math.inf, got)
            at += n
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._group)
        host = buf.cpu()  # one transfer
        out, at = {}, 0
        for layer, n in zip(self.layers, sizes):
            if host[at] > 0:
                out[layer.index] = host[at + 1:at + n]
            at += n
        return out

    def _clip_layer(self, step: int, layer: AttentionLayer, values: list[float]) -> list[Intervention]:
        factors = []
        for h, s in enumerate(values):
            if not math.isfinite(s):
                if s != -math.inf:  # -inf: no allowed key in any row of the head, nothing to clip
                    self._warn(("nonfinite", layer.index), f"diag: QKClip read a non-finite largest logit ({s}) "
                               f"in layer {layer.label} head {h}; a non-finite head is left as it is")
                factors.append(1.0)
            else:
                factors.append(min(1.0, self.tau / s) if s > self.tau else 1.0)
        if all(f == 1.0 for f in factors):
            return []
        kv = layer.layout.kv_index
        group_max: dict[int, float] = {}
        for h, f in enumerate(factors):
            group_max[kv[h]] = max(group_max.get(kv[h], 0.0), f)
        k_factors = [group_max.get(g, 1.0) ** (1.0 - self.alpha) for g in range(layer.layout.kv_heads)]
        q_factors = [f / k_factors[kv[h]] for h, f in enumerate(factors)]
        _scale_heads(layer, q_factors, k_factors)
        return [Intervention(step, layer.label, h, values[h], f, q_factors[h], k_factors[kv[h]])
                for h, f in enumerate(factors) if f < 1.0]

    def _report(self, step: int, done: list[Intervention]) -> None:
        """Reporting never stops training: a failure is warned about once, the clip itself went on."""
        if self.monitor is None:
            return
        try:
            sampled = self.monitor.should_sample(step)
            if done or sampled:
                self.monitor.log_scalars(step, self._scalars(done))
            sink = getattr(self.monitor, "alert_sink", None)
            if done and sink is not None:
                sink.emit([self._alert(step, done)])
        except Exception as err:  # noqa: BLE001 - the training run must go on
            self._warn("report", f"diag: QKClip could not report step {step} ({err!r}); the clip is still applied, "
                       "training continues")

    def _scalars(self, done: list[Intervention]) -> dict[str, float]:
        """The tags of one step (docs/steplimit.md#qk-clip)."""
        out = {f"qk_clip_max_logit/{label}": max(values) for label, values in self.last.items()}
        heads = {layer.label: layer.layout.n_heads for layer in self.layers}
        for i in done:
            out[f"qk_clip_max_logit/{i.layer}/{head_label(i.head, heads[i.layer])}"] = i.max_logit
            out[f"qk_clip_factor/{i.layer}/{head_label(i.head, heads[i.layer])}"] = i.factor
        out["qk_clip_heads"] = float(len(done))
        return out

    def _alert(self, step: int, done: list[Intervention]) -> Alert:
        heads = {layer.label: layer.layout.n_heads for layer in self.layers}
        names = tuple(f"{i.layer}/{head_label(i.head, heads[i.layer])}" for i in done)
        worst = max(done, key=lambda i: i.max_logit)
        layers = sorted({i.layer for i in done})
        return Alert(step, "qk_clip", "info", layers[0] if len(layers) == 1 else "",
                     f"QK-clip scaled W_Q and W_K of {len(done)} head(s) whose largest logit exceeded tau={self.tau:g} "
                     f"(largest {worst.max_logit:.4g} at {worst.layer}/{head_label(worst.head, heads[worst.layer])}, "
                     f"its logits scaled by {worst.factor:.4g}). What to do: {ALERTS['qk_clip'].todo}",
                     {"max_logit": worst.max_logit, "factor": worst.factor, "heads": float(len(done))}, heads=names)

    # ------------------------------------------------------------------ resume and removal

    def state_dict(self) -> dict:
        """tau, alpha, the step count and the number of interventions so far (the list itself is not saved)."""
        return {"tau": self.tau, "alpha": self.alpha, "step_count": self.step_count,
                "interventions": self.n_interventions}

    def load_state_dict(self, state: dict) -> None:
        """Resumes the step count and the number of interventions; ``tau`` and ``alpha`` stay the constructor's
        (a saved value that differs is warned about once)."""
        if QKCLIP_STATE_KEY in state:
            state = state[QKCLIP_STATE_KEY]
        missing = [k for k in ("step_count", "interventions") if k not in state]
        if missing:
            raise ConfigError(f"QKClip.load_state_dict: the state has no {missing}; pass what QKClip.state_dict() "
                              "returned")
        for key in ("tau", "alpha"):
            if key in state and float(state[key]) != getattr(self, key):
                self._warn(("resume", key), f"diag: QKClip resumes with {key}={getattr(self, key):g}, the saved "
                           f"state had {key}={float(state[key]):g}; the constructor's value is used")
        self.step_count = int(state["step_count"])
        self.n_interventions = int(state["interventions"])
        self._arm_for(self.step_count)

    def remove(self) -> None:
        """Remove every hook (the reader's and the optimizer's); the model is left as it is."""
        self.reader.disarm()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self) -> QKClip:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


# ---------------------------------------------------------------------- scaling


def _scale_heads(layer: AttentionLayer, q_factors: list[float], k_factors: list[float]) -> None:
    """Scale each query head's weight (and bias) elements by its factor, each key head's by its own; elements of
    a factor 1 (and every value element) are not written."""
    layout = layer.layout
    named = dict(layer.module.named_parameters())
    roles = packing_of(layout).roles(layout)
    owner = {role: name for name, held in roles.items() for role in held}
    weights = {n: named[n] for n in layout.param_names}
    ids = {n: _ids(p) for n, p in weights.items()}
    q_ids, k_ids, _ = packing_of(layout).split(ids, layout)  # (H, D, E), (G, D, E): element indices
    parts = [(weights[owner["q"]], q_ids, q_factors), (weights[owner["k"]], k_ids, k_factors)]
    biases = biases_of(named, layout.param_names)
    if biases:
        bias_ids = {n: _ids(b) for n, b in biases.items()}
        bq, bk = packing_of(layout).bias(bias_ids, layout)  # (H, D), (G, D) or None
        for role, got, factors in (("q", bq, q_factors), ("k", bk, k_factors)):
            if got is not None:
                parts.append((biases[owner[role]], got, factors))
    with torch.no_grad():
        for param, index, factors in parts:
            _scale_elements(param, index.reshape(len(factors), -1), factors)


def _ids(t: Tensor) -> Tensor:
    """A tensor of ``t``'s shape holding each element's index in ``t.reshape(-1)`` (a DTensor's: in the full
    tensor's), on the device of what this rank holds; int32 where the indices fit (half the transient memory of
    int64: 256 MiB for an 8192 x 8192 weight), made only at a step that clips."""
    n = math.prod(t.shape)
    dtype = torch.int32 if n < 2**31 else torch.int64
    return torch.arange(n, dtype=dtype, device=local_tensor(t).device).reshape(t.shape)


def _in_shard(param: Tensor, where: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A DTensor ``param``: this rank's shard, the elements of ``where`` (flat indices in the full tensor) that lie
    in it, as flat indices in the shard, and their factors. The shard is the block of the full tensor that starts
    at its global offset (``compute_local_shape_and_global_offset``: FSDP2's rows ``offset .. offset + rows``,
    uneven shards included; tensor parallelism's block of heads; FSDP2's rows of that block on a 2-D mesh; a
    replicate dim's copies)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    coords = torch.unravel_index(where, tuple(param.shape))
    inside = torch.ones_like(where, dtype=torch.bool)
    flat = torch.zeros_like(where)
    for c, o, n in zip(coords, offset, shape):
        inside &= (c >= o) & (c < o + n)
        flat = flat * n + (c - o)
    return local, flat[inside], scale[inside]


def _scale_elements(param: Tensor, index: Tensor, factors: list[float]) -> None:
    """Multiply the elements ``index[i]`` of ``param`` (flat indices) by ``factors[i]`` where it is below 1, in
    float64, rounded once to the parameter's dtype."""
    rows = [i for i, f in enumerate(factors) if f < 1.0]
    if not rows:
        return
    where = index[rows].reshape(-1).long()
    scale = torch.tensor([factors[i] for i in rows], dtype=torch.float64, device=param.device)
    scale = scale.repeat_interleave(index.shape[1])
    data = param.detach()
    if is_dtensor(data):  # FSDP2 alone: this rank's elements of those heads
        data, where, scale = _in_shard(data, where, scale)
        if not where.numel():
            return
    flat = data.view(-1) if data.is_contiguous() else data.reshape(-1)
    flat.index_copy_(0, where, (flat[where].double() * scale).to(data.dtype))
    if not data.is_contiguous():
        data.copy_(flat.view(data.shape))


# ---------------------------------------------------------------------- checks


def _check_args(model, tau, alpha, optimizer, every, monitor) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"QKClip(model=...) needs the nn.Module whose attention is clipped, got "
                          f"{type(model).__name__}")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0 or tau == float("inf"):
        raise ConfigError(f"QKClip(tau={tau!r}): expected a finite number > 0, the bound on each head's largest "
                          "logit, e.g. tau=100.0 (Kimi K2)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"QKClip(alpha={alpha!r}): expected a number in [0, 1], the share of the factor on "
                          "W_Q (f^alpha on W_Q, f^(1 - alpha) on W_K), e.g. alpha=0.5")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"QKClip(optimizer=...) needs a torch.optim.Optimizer (the clip follows its every "
                          f"step), got {type(optimizer).__name__}; or leave it out and call clip.step() after "
                          "optimizer.step()")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"QKClip(every={every!r}): expected an integer >= 1 (clip every this many steps), "
                          "e.g. every=1")
    if monitor is not None and not all(hasattr(monitor, a) for a in ("layers", "should_sample", "log_scalars")):
        raise ConfigError(f"QKClip(monitor=...) needs a hooks.Monitor (layers, should_sample and log_scalars), got "
                          f"{type(monitor).__name__}")


def _reduce_group() -> object | None:
    """Every rank, when there are several: each holds some heads' maxima over some part of the batch (replicas,
    FSDP2's or a mesh's data dim: other parts of the batch; tensor parallelism: other heads); None in one
    process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def _check_layer(layer: AttentionLayer, monitored: bool) -> None:
    """Refuse, by name, a layer whose logits QK-clip cannot bound or read, or whose heads' rows are a guess."""
    module, name = layer.module, layer.name
    if layer.record.state == "proposed" and not monitored:
        raise ConfigError(
            f"QKClip: the layout of attention layer {name!r} ({type(module).__name__}) is proposed from names and "
            f"shapes only ({layer.layout.describe()}), and the rows of its heads would be scaled on that guess. "
            "Pass monitor= (a hooks.Monitor confirms the layout from the computation at its first forward) or "
            f"spec={{{layer.patterns[0]!r}: QKVLayout(...)}} (docs/layouts.md#explicit-spec)")
    for child, sub in module.named_modules():
        if child and child.rsplit(".", 1)[-1] in QK_NORMS and not isinstance(sub, nn.Identity):
            raise ConfigError(
                f"QKClip: attention layer {name!r} ({type(module).__name__}) normalises q and k ({child!r}, "
                "QK-norm): scaling its W_Q and W_K does not change its logits, which the norm gains bound. It "
                f"needs no QK-clip; pass QKClip(..., exclude=[{name!r}]) (or a pattern for every such layer)")
    impl = attn_implementation(module)
    if impl not in KERNELS:
        raise ConfigError(f"QKClip: attention layer {name!r} uses attn_implementation={impl!r}, whose kernel does "
                          "not show q, k or logits; build the model with attn_implementation='sdpa' or 'eager'")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    meshes = {t.device_mesh for t in layer.weights().values() if is_dtensor(t)}
    if any(mesh.size() != world for mesh in meshes):
        raise ConfigError(f"QKClip: the weights of attention layer {name!r} are DTensors on a mesh of "
                          f"{next(iter(meshes)).size()} rank(s) in a job of {world}; QK-clip reduces the maxima over "
                          "every rank, so each rank must hold every layer's weights (or its shard of them) on a mesh "
                          "that spans the job (not pipeline stages)")
