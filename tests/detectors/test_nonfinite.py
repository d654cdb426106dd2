"""What the Monitor says of non-finite values no nonfinite_* alert reports, and the fp16 gradient overflow."""

from __future__ import annotations

import math

import numpy as np

from diag.detectors.nonfinite import overflow_alert, overflowed, unreported

NAN = math.nan


def test_non_finite_attention_statistics_alone_are_said_once_with_their_tags():
    scalars = {"loss": 2.0, "qk_sigma1/L00/max": 1.0, "attn_entropy/L00/min": NAN, "attn_rank/L00/max": math.inf}
    said = unreported(7, scalars)
    assert said == ("diag: non-finite values at step 7 (e.g. ['attn_entropy/L00/min', 'attn_rank/L00/max']); "
                    "logged as NaN, training continues")
    assert unreported(7, {"loss": 2.0, "attn_entropy/L00/min": 0.5}) is None


def test_what_follows_from_a_reported_non_finite_value_is_not_said_again():
    for reported in ("loss", "qk_sigma1/L00/max", "grad_norm_q/L00/max"):
        assert unreported(3, {reported: NAN, "attn_entropy/L00/min": NAN}) is None, reported


def test_metrics_already_accounted_for_are_skipped():
    """NaN spectra of a failed solver (reported by the weight side) leave the attention statistics to be said."""
    scalars = {"qk_sigma1/L00/max": NAN, "attn_entropy/L00/min": NAN}
    assert unreported(3, scalars) is None
    assert "attn_entropy/L00/min" in unreported(3, scalars, skip=("qk_sigma1",))
    assert unreported(3, {"qk_sigma1/L00/max": NAN}, skip=("qk_sigma1",)) is None


def test_an_overflow_is_a_non_finite_gradient_metric_and_an_info_alert():
    layers = {"L00": {"grad_norm_q": np.array([1.0, math.inf]), "qk_sigma1": np.array([NAN, 1.0])}}
    assert overflowed(layers)
    assert not overflowed({"L00": {"grad_norm_q": np.array([1.0, 2.0]), "qk_sigma1": np.array([NAN, 1.0])}})
    alert = overflow_alert(12)
    assert (alert.step, alert.kind, alert.level, alert.where) == (12, "gradient_overflow", "info", "")
    assert "GradScaler skips this update" in alert.message


def test_a_non_finite_loss_between_loss_samples_is_critical_through_its_mean():
    """The loss at the sampled step is finite, but one of the steps since the previous sample was not: the mean the
    Monitor keeps of them is, and the nonfinite_loss record says so; it resolves once both are finite again."""
    from diag.detectors import AlertConfig, Detectors, Observation

    det = Detectors(AlertConfig())
    quiet = det.observe(Observation(0, 2.0, {}, loss_mean=2.0))
    fired = det.observe(Observation(10, 1.9, {}, loss_mean=math.inf))
    ended = det.observe(Observation(20, 1.8, {}, loss_mean=1.85))
    assert not [a for a in quiet if a.kind == "nonfinite_loss"]
    (record,) = [a for a in fired if a.kind == "nonfinite_loss"]
    assert record.level == "critical" and "before step 10" in record.message
    assert [(a.kind, a.status) for a in ended if a.kind == "nonfinite_loss"] == [("nonfinite_loss", "resolved")]
