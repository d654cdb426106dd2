"""The spectral step limit (AdamW^2, Qi et al., ICLR 2025) around any torch optimizer.

    opt = SpectralStepLimit(torch.optim.AdamW(model.parameters(), lr=5e-3), tau=0.004, model=model)

Each selected weight matrix (by default every 2-D weight that is not an embedding;
the Q, K and V slices of a fused projection separately when the attention layers
are known) gets the inner optimizer's step, then, when

    r = sigma_1(dW_t) / sigma_1(W_{t-1}) > tau,   dW_t = W_t - W_{t-1},

the step is shrunk to ``W_t = W_{t-1} + dW_t * tau / r``, so the applied step has
ratio tau. sigma_1 by power iteration warm-started from the previous step's right
singular vectors (``iters`` iterations of two mat-vecs each; for dW also from its
largest row; a lower bound of the true value) or, with ``exact=True``, ``torch.linalg.matrix_norm(ord=2)``. The inner
optimizer's state (Adam's moments) is not changed; gradients are never touched; no
random number is drawn after construction. One host transfer per step (the ratios).
See docs/steplimit.md for the choices and their reasons.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from diag.catalog.tags import stat_tag
from diag.errors import ConfigError, WarnOnce
from diag.layouts.packings import packing_of
from diag.math.norms import power_sigma1
from diag.math.updates import Stack, stack_by_shape, update_of, work_dtype
from hooks.parallel.dtensors import local_tensor
from hooks.parallel.splits import Split, split_largest_row, split_of

__all__ = ["SpectralStepLimit", "LimitedMatrix", "StepReporter", "STATE_KEY"]

log = logging.getLogger("diag")

STATE_KEY = "spectral_step_limit"
COLD_ITERS = 20  # power iterations at the first step, from the random start vectors
_TINY = 1e-30
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


@dataclass
class LimitedMatrix:
    """One bounded matrix: a whole parameter or one Q/K/V slice of a fused one."""

    name: str  # e.g. "h.0.attn.c_attn.weight[q]"
    param: nn.Parameter
    view: Callable[[Tensor], Tensor]  # the slice of a tensor shaped like param (a view: writable)
    label: str | None  # attention layer label ("L03") or None outside every layer
    role: str  # "q", "k", "v" or the name inside the layer's block, e.g. "mlp.0"
    v_w: Tensor = field(repr=False, default=None)  # right singular vector estimates of W and dW
    v_dw: Tensor = field(repr=False, default=None)
    split: Split | None = None  # split across ranks (tensor parallelism, FSDP2): this rank holds a block (splits.py)

    def matrix(self, t: Tensor) -> Tensor:
        s = self.view(t)
        if self.view is _whole:
            return s.reshape(s.shape[0], -1)  # (rows, cols); a >2-D weight: first dim x the rest
        return s.reshape(-1, s.shape[-1])  # a Q/K/V slice (H, D, E) -> (H*D, E)

    @property
    def tag_suffix(self) -> str:
        return f"{self.label}/{self.role}" if self.label else self.role


@runtime_checkable
class StepReporter(Protocol):
    """What the step limit needs from a ``hooks.Monitor``: its attention layers (whose fused Q/K/V weights
    are bounded per slice and whose blocks name the tags), when to report, and where."""

    layers: Sequence  # hooks.layout.discover.AttentionLayer

    def should_sample(self, step: int) -> bool: ...

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...


class SpectralStepLimit(torch.optim.Optimizer):
    """Wraps ``optimizer``; bounds sigma_1(dW)/sigma_1(W_prev) <= tau for each selected matrix.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (not stepped by anyone else).
        tau: the bound, > 0 (the paper: 0.004 for ViTs).
        model: gives parameter names and module types; without it every 2-D parameter is
            selected (embeddings included) and names are ``group<g>.param<i>``.
        select: ``(name, param) -> bool`` replacing the default rule (2-D, not owned by an
            ``nn.Embedding``/``EmbeddingBag``).
        include / exclude: fnmatch patterns on parameter names, applied after ``select``.
        attention: attention layers (``monitor.layers`` or ``hooks.layout.discover.discover(model)``)
            whose fused Q/K/V weights are bounded per slice and whose blocks name the tags;
            default: the monitor's layers, else none (fused weights bounded whole).
        split_qkv: bound Q, K, V slices separately (the paper's Wq, Wk, Wv); else whole.
        iters: power iterations per step (two mat-vecs each), >= 1.
        exact: sigma_1 by ``torch.linalg.matrix_norm(ord=2)`` (slow; tests, reference).
        monitor: a ``hooks.Monitor``: on its sampled steps the applied scale, ratio and
            effective learning rate are logged through ``monitor.log_scalars``.
        audit: on sampled steps also log the exact ratio of the applied step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        tau: float = 0.004,
        *,
        model: nn.Module | None = None,
        select: Callable[[str, Tensor], bool] | None = None,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
        attention: Iterable | None = None,
        split_qkv: bool = True,
        iters: int = 2,
        exact: bool = False,
        monitor: StepReporter | None = None,
        audit: bool = False,
    ) -> None:
        _check_args(optimizer, tau, iters, model)
        self.optimizer, self.tau, self.iters, self.exact, self.audit = optimizer, float(tau), iters, exact, audit
        if monitor is not None and not isinstance(monitor, StepReporter):
            raise ConfigError(f"SpectralStepLimit(monitor=...) needs a hooks.Monitor (layers, should_sample and "
                              f"log_scalars), got {type(monitor).__name__}")
        self.monitor, self._warn = monitor, WarnOnce(log, stacklevel=3)
        self.step_count = 0  # calls of step() that reached the inner optimizer
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()  # what Optimizer.__init__ would set:
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()  # the state lives in the inner one
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        layers = list(attention if attention is not None else monitor.layers if monitor is not None else [])
        self.matrices = _select(optimizer, model, select, include, list(exclude), layers, split_qkv)
        _check_splits(self.matrices, exact, audit)
        gen = torch.Generator().manual_seed(0)  # private: the global RNG is never touched
        for m in self.matrices:
            cols = m.matrix(m.param.detach()).shape[-1]  # of the whole matrix (a DTensor's global shape)
            v = torch.randn(cols, generator=gen, dtype=torch.float64)
            v = v / v.norm()
            if m.split is not None:  # this rank's columns of the one-process start vector
                v = v[m.split.first_col : m.split.first_col + m.split.n_cols]
            v = v.to(device=m.param.device, dtype=work_dtype(m.param))
            m.v_w, m.v_dw = v.clone(), v.clone()
        self.totals = {m.name: {"steps": 0, "limited": 0, "scale": 0.0, "lr": 0.0} for m in self.matrices}
        self._cold = True  # the vectors are random until the first step: it iterates COLD_ITERS times
        self.last: dict[str, dict[str, float]] = {}

    # ---------------------------------------------------------- the optimizer surface (delegated)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):  # noqa: ANN201 - the inner optimizer's defaultdict
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:  # noqa: ANN001
        self.optimizer.state = value

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """New groups go to the inner optimizer; their parameters are not limited."""
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"SpectralStepLimit(tau={self.tau:g}, matrices={len(self.matrices)}, {self.optimizer!r})"

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus ``STATE_KEY``: power vectors, step count, totals."""
        out = self.optimizer.state_dict()
        out[STATE_KEY] = {
            "tau": self.tau,
            "step_count": self.step_count,
            "vectors": {m.name: {"w": m.v_w.clone(), "dw": m.v_dw.clone()} for m in self.matrices},
            "totals": {name: dict(t) for name, t in self.totals.items()},
        }
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads the inner state; a state dict without ``STATE_KEY`` (a plain optimizer's) keeps
        the fresh power vectors. ``tau`` stays the constructor's."""
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if ours is not None:
            _check_vectors(ours["vectors"], self.matrices)
        self.optimizer.load_state_dict(state_dict)
        if ours is None:
            self._cold = True
            return
        self._cold = False
        for m in self.matrices:
            m.v_w.copy_(ours["vectors"][m.name]["w"])
            m.v_dw.copy_(ours["vectors"][m.name]["dw"])
        self.step_count = int(ours["step_count"])
        self.totals = {name: dict(ours["totals"][name]) for name in self.totals}

    # ------------------------------------------------------------------ the step

    def step(self, closure: Callable[[], float] | None = None):  # noqa: ANN201 - what the inner step returns
        with torch.no_grad():  # the selected matrices before the inner step, stacked by shape: the base of dW
            stacks = self._stacks()
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        with torch.no_grad():
            self._limit(stacks)
        self.step_count += 1
        self._cold = False
        return loss

    def summary(self) -> dict[str, dict[str, float]]:
        """Per matrix, over all steps so far: mean scale, mean effective lr, fraction of steps limited."""
        return {name: {"mean_scale": t["scale"] / max(t["steps"], 1), "mean_lr": t["lr"] / max(t["steps"], 1),
                       "limited": t["limited"] / max(t["steps"], 1)} for name, t in self.totals.items()}

    def _stacks(self) -> list[Stack[int]]:
        """This rank's part of every selected matrix, stacked by shape and by how it is split across ranks."""
        parts: dict[tuple, list[tuple[int, Tensor]]] = {}
        for i, m in enumerate(self.matrices):
            parts.setdefault(() if m.split is None else m.split.key, []).append((i, _matrix(m)))
        return [stack for items in parts.values() for stack in stack_by_shape(items)]

    def _limit(self, stacks: list[Stack[int]]) -> None:
        deltas = [update_of(g, [_matrix(self.matrices[i]) for i in g.members],
                            in_place=False) for g in stacks]  # dW per stack; g.before kept
        sig_w, sig_dw = self._sigmas(stacks, deltas)
        ratios = (sig_dw / sig_w.clamp_min(_TINY)).where(sig_w > 0, torch.zeros_like(sig_w))
        host = ratios.cpu().tolist()  # the one host transfer per step
        where = {i: (k, j) for k, g in enumerate(stacks) for j, i in enumerate(g.members)}
        lrs = self._lrs()
        self.last = {}
        for i, (m, ratio) in enumerate(zip(self.matrices, host)):
            scale = 1.0
            if ratio == ratio and ratio != float("inf") and ratio > self.tau:  # non-finite: left as is
                scale = self.tau / ratio
                k, j = where[i]
                target = m.view(local_tensor(m.param.data))  # this rank's block where the matrix is split
                target.copy_(torch.add(stacks[k].before[j], deltas[k][j], alpha=scale).reshape(target.shape))
            lr = lrs.get(id(m.param), float("nan")) * scale
            self.last[m.name] = {"scale": scale, "ratio": ratio * scale, "lr": lr}
            t = self.totals[m.name]
            t["steps"] += 1
            t["limited"] += scale < 1.0
            t["scale"] += scale
            t["lr"] += lr
        if self.monitor is not None and self.monitor.should_sample(self.step_count):
            self._report({self.matrices[i].name: stacks[k].before[j] for i, (k, j) in where.items()})

    def _report(self, before: dict[str, Tensor]) -> None:
        """Reporting never stops training: a failure is warned about once, the limit itself went on."""
        try:
            self.monitor.log_scalars(self.step_count, self._scalars(before))
        except Exception as err:  # noqa: BLE001 - the training run must go on
            self._warn("report", f"diag: SpectralStepLimit could not report step {self.step_count} ({err!r}); "
                       "the limit is still applied, training continues")

    def _sigmas(self, stacks: list[Stack[int]], deltas: list[Tensor]) -> tuple[Tensor, Tensor]:
        """sigma_1 of every W_prev and dW, batched per stack, in the matrices' order."""
        out_w: list[Tensor | None] = [None] * len(self.matrices)
        out_dw: list[Tensor | None] = [None] * len(self.matrices)
        for g, dw in zip(stacks, deltas):
            mats = [self.matrices[i] for i in g.members]
            w, split = g.before, mats[0].split  # a stack holds matrices split alike (self._stacks)
            if self.exact:
                s_w, s_dw = (torch.linalg.matrix_norm(a, ord=2) for a in (w, dw))
            else:
                iters = max(self.iters, COLD_ITERS) if self._cold else self.iters
                sums = {} if split is None else {"rows": split.sum_rows, "cols": split.sum_cols}
                s_w, v_w = power_sigma1(w, torch.stack([m.v_w for m in mats]).unsqueeze(1), iters, **sums)
                warm = torch.stack([m.v_dw for m in mats])  # (B, n)
                starts = torch.stack([warm, split_largest_row(dw, warm, split)], dim=1)
                s_dw, v_dw = power_sigma1(dw, starts, iters, **sums)
                for j, m in enumerate(mats):
                    if bool(torch.isfinite(v_w[j]).all()):  # a NaN update must not poison the warm start
                        m.v_w.copy_(v_w[j])
                    if bool(torch.isfinite(v_dw[j]).all()):
                        m.v_dw.copy_(v_dw[j])
            for j, i in enumerate(g.members):
                out_w[i], out_dw[i] = s_w[j], s_dw[j]
        device = self.matrices[0].param.device
        return torch.stack([s.to(device, torch.float64) for s in out_w]), torch.stack(
            [s.to(device, torch.float64) for s in out_dw])

    def _lrs(self) -> dict[int, float]:
        return {id(p): float(g.get("lr", float("nan"))) for g in self.param_groups for p in g["params"]}

    def _scalars(self, before: dict[str, Tensor]) -> dict[str, float]:
        """The tags of one sampled step (docs/steplimit.md#tags)."""
        out: dict[str, float] = {}
        by_layer: dict[str, list[dict]] = {}
        for m in self.matrices:
            values = dict(self.last[m.name])
            if self.audit:
                prev = before[m.name]  # (rows, cols) in the compute dtype
                applied = m.matrix(m.param.detach()).to(prev.dtype) - prev
                values["ratio_exact"] = float(torch.linalg.matrix_norm(applied.double(), ord=2)
                                              / torch.linalg.matrix_norm(prev.double(), ord=2))
            for key, value in values.items():
                out[f"step_limit_{key}/{m.tag_suffix}"] = value
            if m.label:
                by_layer.setdefault(m.label, []).append(values)
        for label, rows in by_layer.items():
            for key in ("scale", "lr"):
                vals = [r[key] for r in rows]
                out[stat_tag(f"step_limit_{key}", label, "mean")] = sum(vals) / len(vals)
                out[stat_tag(f"step_limit_{key}", label, "min")] = min(vals)
        out["step_limit_limited"] = sum(v["scale"] < 1.0 for v in self.last.values()) / max(len(self.last), 1)
        return out


# ---------------------------------------------------------------------- helpers


def _check_args(optimizer: object, tau: object, iters: object, model: object) -> None:
    if isinstance(optimizer, SpectralStepLimit):
        raise ConfigError("SpectralStepLimit(optimizer=...) is already a SpectralStepLimit; wrap the inner "
                          "optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"SpectralStepLimit(optimizer=...) needs a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}; pass e.g. torch.optim.AdamW(model.parameters())")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0 or tau == float("inf"):
        raise ConfigError(f"SpectralStepLimit(tau={tau!r}): expected a finite number > 0, e.g. tau=0.004")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ConfigError(f"SpectralStepLimit(iters={iters!r}): expected an integer >= 1, e.g. iters=2")
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(f"SpectralStepLimit(model=...) needs an nn.Module, got {type(model).__name__}")


def _matrix(m: LimitedMatrix) -> Tensor:
    """The matrix as this rank holds it: its block where it is split across ranks."""
    return m.matrix(local_tensor(m.param.detach()))


def _check_splits(matrices: list[LimitedMatrix], exact: bool, audit: bool) -> None:
    """Read how each matrix is split across ranks; what cannot be bounded split is refused now, by name."""
    for m in matrices:
        split = split_of(m.name, m.param)
        if split is not None and m.view is not _whole:
            raise ConfigError(f"SpectralStepLimit: {m.name!r} is a slice of a fused weight that is split across ranks "
                              f"({m.param.placements}); its rows on this rank are not its slice's; bound it whole "
                              f"(split_qkv=False) or exclude it (exclude=[{m.name.split('[')[0]!r}])")
        if split is not None and (exact or audit):
            raise ConfigError(f"SpectralStepLimit(exact={exact}, audit={audit}): {m.name!r} is split across ranks "
                              f"({m.param.placements}); the exact sigma_1 needs the whole matrix on one rank; use "
                              "the power iteration (exact=False, audit=False) there")
        m.split = split


def _names(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> list[tuple[str, nn.Parameter, bool]]:
    """(name, parameter, is an embedding's) for every parameter of the optimizer, in group order."""
    known: dict[int, str] = {}
    embedding: set[int] = set()
    if model is not None:
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                known.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
                if isinstance(module, _EMBEDDINGS):
                    embedding.add(id(p))  # a tied lm_head shares this parameter: excluded too
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            out.append((known.get(id(p), f"group{g}.param{i}"), p, id(p) in embedding))
    return out


def _select(optimizer, model, select, include, exclude, layers, split) -> list[LimitedMatrix]:
    include = None if include is None else list(include)
    blocks = _blocks(layers, model)
    out: list[LimitedMatrix] = []
    for name, p, is_embedding in _names(optimizer, model):
        chosen = select(name, p) if select is not None else (p.dim() == 2 and not is_embedding)
        if include is not None:
            chosen = chosen and any(fnmatch.fnmatchcase(name, pat) for pat in include)
        if not chosen or any(fnmatch.fnmatchcase(name, pat) for pat in exclude):
            continue
        if p.dim() < 2:
            raise ConfigError(f"SpectralStepLimit: {name!r} has shape {tuple(p.shape)}; only matrices "
                              "(2-D or more, rows = first dim) can be bounded. Fix select=/include=")
        out.extend(_matrices(name, p, blocks, split))
    if not out:
        raise ConfigError("SpectralStepLimit: no parameter selected (the default takes 2-D weights that are "
                          "not embeddings); check model=, select=, include= and exclude=")
    return out


def _blocks(layers: list, model: nn.Module | None) -> list[tuple[str, str, object, dict[int, str]]]:
    """(block prefix, label, the layer, {param id: name in layout}) per attention layer.

    The layer's layout is asked for when a step is bounded, not now: a layout discovered from names is provisional
    until the first forward, when the layer's book (hooks/layout/book.py) may replace it with the one read from
    the computation."""
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    out = []
    for layer in layers:
        name = getattr(layer, "name", None) or names.get(id(layer.module), "")
        prefix = name.rsplit(".", 1)[0] + "." if "." in name else (name + "." if name else "")
        out.append((prefix, layer.label, layer, {id(p): n for n, p in layer.params().items()}))
    return out


def _matrices(name: str, p: nn.Parameter, blocks: list, split: bool) -> list[LimitedMatrix]:
    for _, label, layer, params in blocks:
        if id(p) in params:
            views = _qkv_views(layer, params[id(p)]) if split else [("qkv", _whole)]
            return [LimitedMatrix(f"{name}[{role}]" if len(views) > 1 else name, p, view, label, role)
                    for role, view in views]
    for prefix, label, _, _ in blocks:
        if prefix and name.startswith(prefix):
            return [LimitedMatrix(name, p, _whole, label, name[len(prefix):].removesuffix(".weight"))]
    return [LimitedMatrix(name, p, _whole, None, name.removesuffix(".weight"))]


def _whole(t: Tensor) -> Tensor:
    return t


def _qkv_views(layer, pname: str) -> list[tuple[str, Callable[[Tensor], Tensor]]]:
    """The roles a layout parameter holds (its packing says which), each with a view function (views share
    storage, so the limited step is written back through them) that slices by the layer's layout at the time of
    the call."""
    roles = packing_of(layer.layout).roles(layer.layout)[pname]
    if len(roles) == 1:
        return [(roles[0], _whole)]
    return [(role, lambda t, role=role: packing_of(layer.layout).role_views(t, pname, layer.layout)[role])
            for role in roles]


def _check_vectors(vectors: dict, matrices: list[LimitedMatrix]) -> None:
    names = [m.name for m in matrices]
    if sorted(vectors) != sorted(names):
        missing = sorted(set(names) - set(vectors))[:3]
        extra = sorted(set(vectors) - set(names))[:3]
        raise ConfigError(f"SpectralStepLimit.load_state_dict: the saved matrices differ from this one's "
                          f"(missing {missing}, unknown {extra}); build the limiter with the same model, "
                          "selection and attention layers as the run that saved it")
    for m in matrices:
        if tuple(vectors[m.name]["w"].shape) != tuple(m.v_w.shape):
            raise ConfigError(f"SpectralStepLimit.load_state_dict: {m.name!r} saved vector has shape "
                              f"{tuple(vectors[m.name]['w'].shape)}, expected {tuple(m.v_w.shape)}")
