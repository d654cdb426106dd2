"""The goals a run is judged on: which runs a goal applies to, and its verdict on the rows the replay wrote."""

from __future__ import annotations

import pytest

from evaluation.headlines import headline_table, verdicts, wilson


def _hf(purpose, bad=(), critical=(), plateaus=0, sinks=0):
    return {"default": {"kind": "hf", "purpose": purpose, "twin": "", "bad": list(bad), "critical": list(critical),
                        "plateau_alerts": plateaus, "sinks": sinks, "records": 1}}


def test_a_fine_tune_and_a_healthy_run_are_judged_on_their_own_goals():
    fine = verdicts(_hf("sinks", sinks=3))
    assert fine == {"finetune_quiet": True, "finetune_sinks_info": True, "finetune_no_plateau": True,
                    "records_per_head": True}
    noisy = verdicts(_hf("sinks", bad=["malignant_collapse@10:L01"], plateaus=1))
    assert not noisy["finetune_quiet"] and not noisy["finetune_no_plateau"] and not noisy["finetune_sinks_info"]
    healthy = verdicts(_hf("healthy", bad=["malignant_collapse@10:L01/H02"]))
    assert healthy == {"healthy_no_critical": True, "healthy_no_warning": False, "healthy_no_plateau": True,
                       "records_per_head": True}


def test_a_healthy_plateau_alert_counts_against_the_run_only_where_its_twin_denies_the_plateau():
    def run(plateaus, real, has_twin=True):
        rows = _hf("healthy", plateaus=plateaus)
        rows["default"].update(plateau_real=real, has_twin=has_twin)
        return verdicts(rows).get("healthy_plateau_by_twin")

    assert run(1, False) is False  # the twin leaves the level no sooner: no plateau by the twin
    assert run(1, True) is True and run(0, None) is True  # confirmed by the twin; or no alert
    assert run(1, None, has_twin=False) is None  # no twin: the goal does not apply


def _collapse(damaged, critical=(), twin=""):
    d = {"kind": "collapse", "lr": 1e-2, "twin": twin, "onset": None, "quiet_record": False, "false_records": [],
         "heads": [], "damaged": damaged, "alarm_before_damage": True if damaged else None,
         "critical": list(critical), "records": 1}
    return {"default": d}


def test_a_critical_record_counts_against_a_run_the_twin_test_does_not_call_damaged():
    assert verdicts(_collapse(False, ["collapse_damage@90:L01"]))["no_critical_without_damage"] is False
    assert verdicts(_collapse(False, twin="qknorm"))["no_critical_without_damage"] is True
    assert "no_critical_without_damage" not in verdicts(_collapse(True, ["collapse_damage@90:L01"]))


def test_a_normsoftmax_plateau_is_to_be_flagged_before_its_jump():
    row = {"kind": "eureka", "twin": "normsoftmax", "jump": 900, "plateau": 300, "plateau_in_time": True,
           "offset": 1, "false_moments": 0, "records": 1}
    assert verdicts({"default": row, 2: row})["normsoftmax_flagged"] is True
    late = {**row, "plateau": None, "plateau_in_time": False}
    assert verdicts({"default": late})["normsoftmax_flagged"] is False
    assert "normsoftmax_flagged" not in verdicts({"default": {**row, "jump": None}})


def test_the_headline_counts_each_run_once_with_its_interval():
    judged = {"a": {"healthy_no_warning": True}, "b": {"healthy_no_warning": False}}
    line = next(x for x in headline_table(judged) if x.startswith("| healthy runs from scratch: no warning"))
    lo, hi = wilson(1, 2)
    assert f"| 2 | 1 | 50.0% | {lo:.1%}-{hi:.1%} | b |" in line
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
