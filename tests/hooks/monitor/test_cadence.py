"""The per-family cadence: which step samples which family, visible in the tags' steps.

* The default samples the loss and the gradient norms every 10 steps, the spectra every 20 and
  attention every 50 and update ratios every 100; each family's tags carry exactly its steps.
* What a family logs at a step it samples equals what the uniform ``every=10``
  Monitor logs there: thinning the cadence loses no accuracy.
* ``every=N`` samples every family every N steps; ``cadence=``
  overrides single families; bad values name the family and the fix.
* The capture is armed only before steps that sample attention; the TensorBoard
  layout waits for a step that samples every family (a resumed run).
* The closer look: while the detectors ask for it (a head's sigma_1 grows fast, a
  collapse is being confirmed), attention is sampled with the spectra, with the very
  numbers of the uniform cadence; ``closer_look=False`` and a quiet run never do.
"""

from __future__ import annotations

import math

import pytest
import torch

from diag.detectors import AlertConfig, DetectorWrapper
from diag.errors import ConfigError
from diag.outputs.sinks import MemorySink
from hooks import Monitor
from hooks.monitor.cadence import DEFAULT_CADENCE, FAMILIES, CloserLook, resolve_cadence
from tests.support import zoo

FAMILY_OF = {"loss": "loss", "grad_": "grads", "qk_": "spectra", "attn_": "attention", "update_": "updates",
             "collapse_risk": "attention"}  # judged from a sample with both spectra and attention


def family(tag: str) -> str:
    return next(f for prefix, f in FAMILY_OF.items() if tag.startswith(prefix))


def train(steps: int, start: int = 0, wrap=None, **monitor_kwargs) -> tuple[MemorySink, list[bool]]:
    """A tiny nanoGPT (dropout off) trained ``steps`` steps from step ``start``; the sink, and whether
    the capture was armed after each step's monitor.step call. ``wrap``: applied to the Monitor's detectors."""
    case = zoo.nanogpt(dropout=0.0)
    sink = MemorySink()
    monitor = Monitor(case.model, sinks=[sink], images=False, **monitor_kwargs)
    if wrap is not None:
        monitor.detectors = wrap(monitor.detectors)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    armed = []
    for step in range(start, start + steps):
        loss = case.loss(case.model, case.make_batch(gen))
        loss.backward()
        monitor.step(step, loss=loss)
        armed.append(monitor.capture.armed)
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    return sink, armed


def steps_by_family(sink: MemorySink) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for record in sink.records:
        for tag in record.scalars:
            if not tag.startswith("alerts/"):
                out.setdefault(family(tag), set()).add(record.step)
    return out


@pytest.fixture(scope="module")
def default_run() -> MemorySink:
    return train(201)[0]


def test_default_cadence_is_visible_in_the_tags_steps(default_run):
    seen = steps_by_family(default_run)
    assert seen == {f: set(range(0, 201, DEFAULT_CADENCE[f])) for f in FAMILIES}
    assert DEFAULT_CADENCE["loss"] == DEFAULT_CADENCE["grads"] == 10 and DEFAULT_CADENCE["spectra"] == 20
    assert DEFAULT_CADENCE["attention"] == 50 and DEFAULT_CADENCE["updates"] == 100


def test_thinned_families_equal_the_uniform_cadence_at_shared_steps(default_run):
    """At steps both sample, the default cadence logs the very numbers of every=10 (tiny heads: exact
    sigma_1, so no warm start makes them differ)."""
    uniform = train(201, every=10)[0]
    # collapse_risk is judged from the samples a cadence gives (its trends): not a measurement to compare
    judged = ("alerts/", "collapse_risk/")
    ref = {(r.step, t): v for r in uniform.records for t, v in r.scalars.items() if not t.startswith(judged)}
    got = {(r.step, t): v for r in default_run.records for t, v in r.scalars.items() if not t.startswith(judged)}
    assert set(got) <= set(ref)
    assert {k for k in ref if k[0] % DEFAULT_CADENCE[family(k[1])] == 0} == set(got)
    bad = [k for k in got if not math.isclose(got[k], ref[k], rel_tol=1e-9, abs_tol=1e-12)]
    assert not bad, bad[:5]


def test_every_keeps_its_uniform_meaning():
    sink, armed = train(7, every=3)
    assert steps_by_family(sink) == {f: {0, 3, 6} for f in FAMILIES}
    assert [s for s, a in enumerate(armed) if a] == [2, 5]  # armed after 2 and 5: before 3 and 6


def test_cadence_overrides_single_families():
    sink, armed = train(13, every=4, cadence={"attention": 6, "loss": 1})
    seen = steps_by_family(sink)
    assert seen["attention"] == {0, 6, 12} and seen["loss"] == set(range(13))
    assert seen["spectra"] == seen["grads"] == seen["updates"] == {0, 4, 8, 12}
    assert [s for s, a in enumerate(armed) if a] == [5, 11]


def test_signals_off_have_no_cadence():
    cadence = resolve_cadence(None, {"spectra": 7}, ("spectra", "grads"))
    assert dict(cadence.periods) == {"loss": 10, "grads": 10, "spectra": 7}
    assert cadence.due(70) == {"loss", "grads", "spectra"} and cadence.due(7) == {"spectra"}
    assert cadence.full == 70 and cadence.base == 7


@pytest.mark.parametrize("kwargs, words", [
    ({"cadence": {"atention": 5}}, ["atention", "choose from"]),
    ({"cadence": {"spectra": 0}}, ["'spectra': 0", "integer >= 1"]),
    ({"cadence": [("spectra", 5)]}, ["cadence=", "mapping"]),
    ({"every": 0}, ["every=0", "integer >= 1"]),
])
def test_bad_cadence_names_the_family_and_the_fix(kwargs, words):
    with pytest.raises(ConfigError) as info:
        Monitor(zoo.nanogpt().model, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_image_every_is_a_multiple_of_the_full_period():
    with pytest.raises(ConfigError, match=r"image_every=150.*multiple of 100 .*cadence.*image_every=1000"):
        Monitor(zoo.nanogpt().model, image_every=150)


def test_layout_waits_for_a_step_that_samples_every_family(tmp_path):
    """A run resumed at step 1234: the first steps sample loss and grads only; the layout (charts of
    every family) is written at 1300, the first step that samples them all."""
    case = zoo.nanogpt(dropout=0.0)
    sink = MemorySink()
    monitor = Monitor(case.model, sinks=[sink], images=False, cadence={"loss": 1, "grads": 1})
    gen = torch.Generator().manual_seed(0)
    for step in list(range(1234, 1237)) + [1299, 1300]:
        case.loss(case.model, case.make_batch(gen)).backward()
        monitor.step(step)
        case.model.zero_grad(set_to_none=True)
        if step < 1300:
            assert not sink.layouts
    monitor.close()
    assert len(sink.layouts) == 1
    charts = str(sink.layouts[0])
    assert all(metric in charts for metric in ("qk_sigma1", "attn_entropy", "grad_norm_q", "update_ratio_q"))


def assert_values_of(sink, uniform) -> None:
    """Every attention and spectral value ``sink`` logged equals the uniform-interval run's at that step."""
    watched = ("attn_", "qk_")
    ref = {(r.step, t): v for r in uniform.records for t, v in r.scalars.items() if t.startswith(watched)}
    got = {(r.step, t): v for r in sink.records for t, v in r.scalars.items() if t.startswith(watched)}
    assert got and set(got) <= set(ref)
    bad = [k for k in got if not math.isclose(got[k], ref[k], rel_tol=1e-9, abs_tol=1e-12)]
    assert not bad, bad[:5]


def test_closer_look_samples_attention_with_the_spectra_while_asked(default_run):
    """watch_growth=1.01: any growth of sigma_1 puts the layer at risk, from the second spectra sample on (step
    20: growth over 0..20), and the detectors are asked again at every judged step: attention and the spectra
    every 10 steps from 30 on, with the very values of every=10."""
    cfg = AlertConfig(watch_growth=1.01)
    sink, armed = train(201, alerts=cfg)
    seen = steps_by_family(sink)
    closer = set(range(30, 201, 10))
    assert seen["attention"] == {0} | closer and seen["spectra"] == {0, 20} | closer
    assert {f: s for f, s in seen.items() if f not in ("attention", "spectra")} == \
        {f: set(range(0, 201, DEFAULT_CADENCE[f])) for f in FAMILIES if f not in ("attention", "spectra")}
    assert [s for s, a in enumerate(armed) if a][:3] == [29, 39, 49]
    uniform = train(201, every=10)[0]
    assert_values_of(sink, uniform)
    off = steps_by_family(train(201, alerts=cfg, closer_look=False)[0])
    assert off["attention"] == {0, 50, 100, 150, 200}
    assert steps_by_family(default_run)["attention"] == {0, 50, 100, 150, 200}  # this quiet run never asked


def test_large_first_updates_put_the_run_at_risk_for_their_horizon():
    """note_ratio=1e-6: every run's first update is 'large', noted when step 0's update ratio is measured
    (during monitor.step(1)). Attention and the spectra are sampled with every loss sample while the note holds
    (its first 50 steps), and the sample at 50 asks for one more."""
    cfg = AlertConfig(note_ratio=1e-6)
    sink, armed = train(101, alerts=cfg)
    seen = steps_by_family(sink)
    early = set(range(0, 61, 10)) | {100}
    assert seen["attention"] == early and seen["spectra"] == early | {80}
    assert seen["loss"] == seen["grads"] == set(range(0, 101, 10))
    uniform = train(101, every=10)[0]
    assert_values_of(sink, uniform)


class Asking:
    """Detectors that ask for a close look: ``near`` and ``at_risk`` reasons while the step is in the ranges."""

    def __init__(self, near=range(0), risk=range(0)) -> None:
        self.near_steps, self.risk_steps, self.step = near, risk, -1

    def near(self):
        return "a head came near" if self.step in self.near_steps else None

    def at_risk(self):
        return "a layer at risk" if self.step in self.risk_steps else None


def test_closer_look_samples_every_step_while_near_and_every_loss_sample_while_at_risk():
    cadence = resolve_cadence(None, None, ("spectra", "attention"))
    look, ask = CloserLook(cadence), Asking(near=range(40, 44), risk=range(10, 31))
    assert look.period == 10 and not look.adds(20)
    sampled = []
    for step in range(0, 80):
        ask.step = step
        added = look.adds(step)
        if added:
            sampled.append((step, sorted(added)))
        if step % 10 == 0 or added:  # a judged step
            look.heed(step, ask)
    both, attention = ["attention", "spectra"], ["attention"]
    # at risk from 10: with the loss samples up to 40; near while 40-43 are judged: every step up to 44
    assert sampled == [(20, both), (30, both), (40, both), (41, attention), (42, attention), (43, attention),
                       (44, attention)]
    started = CloserLook(cadence)
    ask.step = 10
    assert started.heed(10, ask) == ["a layer at risk: attention and the spectra sampled every 10 steps"]
    ask.step = 20
    assert started.heed(20, ask) == []  # renewed, not started again
    assert CloserLook(resolve_cadence(10, None, ("spectra", "attention"))).period is None
    fast_spectra = CloserLook(resolve_cadence(None, {"spectra": 10}, ("spectra", "attention")))
    ask.step = 10
    fast_spectra.heed(10, ask)
    assert fast_spectra.adds(20) == {"attention"}  # the spectra are sampled every 10 steps anyway
    assert CloserLook(cadence, enabled=False).period is None


def test_a_malignant_state_being_settled_is_sampled_every_step_by_the_monitor():
    """Lines so loose that every head is inside the malignant state at its first sample (step 0): its dwell (2
    samples, 10 steps) is settled on attention every step (steps no family samples otherwise), with the very
    values of every=1, and the head is established at step 10, not at the next 10-step sample's 20; then the
    cadence again. With collapse_persist=1 the state is established at once: nothing to settle, no close
    samples."""
    loose = dict(sparse_entropy=10.0, low_rank_frac=1.0, collapse_dwell=10)
    sink, _ = train(41, alerts=AlertConfig(collapse_persist=2, **loose))
    seen = steps_by_family(sink)
    assert set(range(0, 11)) <= seen["attention"] and not {11, 12, 15} & seen["attention"]
    assert seen["loss"] == set(range(0, 41, 10))
    opened = [r for r in sink.records if "alerts/malignant_collapse" in r.scalars]
    assert opened and min(r.step for r in opened) == 10
    assert_values_of(sink, train(41, every=1)[0])
    at_once, _ = train(41, alerts=AlertConfig(collapse_persist=1, **loose))
    assert not {1, 2, 3, 5, 8} & steps_by_family(at_once)["attention"]


class _Near(DetectorWrapper):
    """The Monitor's detectors, with a head near the lines while the last step they judged is in ``steps``."""

    def __init__(self, inner, steps: range) -> None:
        super().__init__(inner)
        self.steps, self.last = steps, -1

    def observe(self, obs):
        self.last = obs.step
        return self.inner.observe(obs)

    def near(self):
        return "L00/H00 came near the malignant lines" if self.last in self.steps else None


def test_the_monitor_samples_attention_at_every_step_while_a_head_is_near():
    """A head near the lines while the detectors judge steps 40-60: the Monitor samples attention at every step
    from 41 to 61 (the step after the last judged one asked), arming the capture the step before, with the very
    values of every=1; the spectra come with the loss samples meanwhile (50)."""
    reference = train(81, every=1)[0]
    sink, _ = train(81, wrap=lambda detectors: _Near(detectors, range(40, 61)))
    seen = steps_by_family(sink)
    assert seen["attention"] == {0, 50} | set(range(41, 62))
    assert seen["spectra"] == set(range(0, 81, 20)) | {50} and seen["loss"] == set(range(0, 81, 10))
    assert_values_of(sink, reference)


class Spy(DetectorWrapper):
    """The Monitor's detectors, with every observation of a sampled step they are given kept."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.seen = []

    def observe(self, obs):
        self.seen.append(obs)
        return self.inner.observe(obs)


def spied_run(steps: int, give=lambda step, loss: loss) -> tuple[Spy, list[float], MemorySink, Monitor]:
    """A tiny nanoGPT at the default cadence; ``give(step, loss)`` is what the loop passes monitor.step."""
    case = zoo.nanogpt(dropout=0.0)
    sink = MemorySink()
    monitor = Monitor(case.model, sinks=[sink], images=False)
    spy = monitor.detectors = Spy(monitor.detectors)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        loss = case.loss(case.model, case.make_batch(gen))
        loss.backward()
        losses.append(loss.item())
        monitor.step(step, loss=give(step, loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return spy, losses, sink, monitor


@pytest.mark.parametrize("as_float", [False, True])
def test_the_detectors_get_the_mean_loss_of_the_steps_since_the_last_loss_sample(as_float):
    """At the default cadence the loss is sampled every 10 steps; the detectors also get the mean of the losses of
    the steps since the last loss sample (Observation.loss_mean: the plateau detector's loss, ten batches instead
    of one), accumulated where the loss lives. The ``loss`` tag and Observation.loss stay the sampled step's."""
    spy, losses, sink, monitor = spied_run(33, (lambda step, loss: loss.item()) if as_float else (lambda s, x: x))
    given = [o for o in spy.seen if o.loss is not None]
    assert [o.step for o in given] == [0, 10, 20, 30]
    previous = -1
    for o in given:
        assert o.loss == pytest.approx(losses[o.step], rel=1e-6)
        expected = sum(losses[previous + 1:o.step + 1]) / (o.step - previous)
        assert o.loss_mean == pytest.approx(expected, rel=1e-5), o.step
        previous = o.step
    assert given[1].loss_mean != pytest.approx(given[1].loss, rel=1e-5)  # ten batches, not one
    tagged = {r.step: r.scalars["loss"] for r in sink.records if "loss" in r.scalars}
    assert tagged == pytest.approx({o.step: o.loss for o in given}, rel=1e-6)
    kept = monitor._loss_mean  # steps 31 and 32's
    assert kept.count == 2 and len(kept.tensors) == (0 if as_float else 2)
    assert all(t.grad_fn is None and not t.requires_grad for t in kept.tensors)  # no graph kept
    monitor.close()
    assert kept.count == 0 and kept.tensors == []  # nothing of the run's tensors kept


def test_a_loop_that_passes_the_loss_only_on_sampled_steps_gets_that_loss_as_the_mean():
    spy, losses, _, monitor = spied_run(21, lambda step, loss: loss if step % 10 == 0 else None)
    monitor.close()
    given = [o for o in spy.seen if o.loss is not None]
    assert [o.step for o in given] == [0, 10, 20]
    assert all(o.loss_mean == pytest.approx(losses[o.step], rel=1e-6) for o in given)


def test_losses_kept_for_a_rare_loss_sample_are_folded_on_their_device_and_still_averaged():
    """A loss sampled every 1,000 steps keeps no thousand tensors: every 64 are summed into one (on their device,
    no host read); the mean is the same. Numbers and tensors may mix."""
    from hooks.monitor.lossmean import FOLD, LossMean

    values = [1.0 + 0.01 * i for i in range(150)]
    kept = LossMean()
    for i, v in enumerate(values):
        kept.add(torch.tensor([v]) if i % 3 else v)
        assert len(kept.tensors) < FOLD
    assert float(kept.take()) == pytest.approx(sum(values) / len(values), rel=1e-6)
    assert kept.take() is None and kept.count == 0
