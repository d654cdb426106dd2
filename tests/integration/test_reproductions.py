"""Short versions of the reproductions behind the alerts (evaluation/seeds.py lists the long ones).

Collapse: the demo GPT without warmup gets the large-early-updates note and its warmup twin stays silent.
Eureka: the 2x2-digits task labels what it claims, the ViT and its NormSoftmax twin are monitored, and at
initialisation the softmax ViT shows Hoffmann et al.'s small Q/K-to-V gradient ratio that NormSoftmax removes.
The ground truth of evaluation/truth.py (damage against the QK-norm twin, the plateau's twin test, the
accuracy jump, the no-indicator accuracy) is checked on scripted inputs against direct definitions; the
attention states' ground truth is the detectors' own definition (tests/detectors/test_states.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation import eureka
from evaluation.spec import RunSpec
from evaluation.truth import (
    Run,
    accuracy_jump,
    accuracy_rise,
    damage,
    leaves,
    plateau_by_twin,
    settled,
    stuck_with_twin,
)
from hooks.demo import DemoRun, train

# ------------------------------------------------------------------ collapse


@pytest.mark.parametrize("warmup", [0, 100])
def test_demo_notes_large_first_updates_without_warmup_and_is_quiet_with_it(tmp_path, warmup):
    """Large first updates (no warmup) are no collapse warning: the honest signal at step 0 is the info note on
    large first updates, and the warmup twin gets none."""
    monitor, losses = train(DemoRun(logdir=tmp_path / "run", steps=41, warmup=warmup, quiet=True))
    alerts = monitor.alert_sink.history
    notes = [a.step for a in alerts if a.kind == "large_early_updates"]
    if warmup:
        assert alerts == [] and notes == []
    else:
        assert notes == [0], alerts
    assert all(math.isfinite(x) for x in losses)


def _run(losses: list[float]) -> Run:
    return Run(RunSpec("lm", 0, 5e-3, len(losses)), Path("/nonexistent"), {"losses": losses})


def test_damage_is_a_final_loss_clearly_over_the_twins_from_where_they_separate_for_good():
    twin = _run([2.0] * 200)
    # 15% over the twin from step 100 on; an excursion at 20-29 ends, so it is not where the damage begins
    run = _run([2.0] * 20 + [3.0] * 10 + [2.0] * 70 + [2.3] * 100)
    assert damage(run, twin) == (True, 87)  # the first 20-step mean over 1.05 x 2.0 that stays over: 7 of 2.3
    assert damage(twin, run) == (False, None)
    assert damage(_run([2.0] * 150 + [2.06] * 50), twin) == (False, None)  # 3% over: within the twins' spread
    assert damage(run, None) == (None, None)


def test_the_twin_test_of_a_plateau():
    run = _run([3.0] * 150 + [2.5] * 50 + [1.5] * 200)
    quick = _run([3.0] * 20 + [1.5] * 380)
    slow = _run([3.0] * 90 + [1.5] * 310)
    # the first 20-step mean under 2.8 that stays under: 9 of 2.5 (run), 3 of 1.5 (quick)
    assert leaves(run.losses, 2.8) == 139 and leaves(quick.losses, 2.8) == 3
    assert plateau_by_twin(run, quick, 2.8) is True  # 136 steps sooner: >= 25% of 400
    assert plateau_by_twin(run, slow, 2.8) is False
    assert plateau_by_twin(run, _run([3.0] * 400), 2.8) is False and plateau_by_twin(run, None, 2.8) is None
    # neither leaves the level (as BERT runs and their twins at the context-free level): stuck,
    # and the twin test has no verdict on the cause; a run that leaves it is not stuck
    flat = _run([3.0] * 400)
    assert stuck_with_twin(flat, _run([3.0] * 400), 2.8) and plateau_by_twin(flat, _run([3.0] * 400), 2.8) is False
    assert not stuck_with_twin(run, _run([3.0] * 400), 2.8) and not stuck_with_twin(flat, quick, 2.8)
    assert not stuck_with_twin(flat, None, 2.8)


# ------------------------------------------------------------------ Eureka


@pytest.fixture(scope="module")
def data():
    return eureka.DigitGrid()


def test_grid_label_is_the_digit_the_indicator_names(data):
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(len(data.train_labels), (64, 4), generator=gen)
    grid, label = data.compose(data.train_images, data.train_labels, idx)
    for b in range(64):  # a per-sample reference: cells in reading order, indicator top-left
        cells = [grid[b, :8, :8], grid[b, :8, 8:], grid[b, 8:, :8], grid[b, 8:, 8:]]
        for c in range(4):
            assert torch.equal(cells[c], data.train_images[idx[b, c]])
        named = 1 + int(data.train_labels[idx[b, 0]]) % 3
        assert int(label[b]) == int(data.train_labels[idx[b, named]])
    # the fixed split: every image of the set in exactly one part (an image the set holds twice may be in both)
    assert len(data.train_labels) + len(data.val_labels) == 1797 and len(data.val_labels) == 449
    from collections import Counter

    from sklearn.datasets import load_digits

    twice = {k for k, n in Counter(x.tobytes() for x in (load_digits().images / 16.0).astype("float32")).items()
             if n > 1}
    train = {x.numpy().astype("float32").tobytes() for x in data.train_images}
    val = {x.numpy().astype("float32").tobytes() for x in data.val_images}
    assert train & val <= twice


def test_blind_accuracy_by_enumeration(data):
    # exact expectation by enumerating the oracle's choices: it picks each most frequent candidate class with
    # equal chance (a 3-way tie among distinct classes gives 1/3)
    idx = torch.randint(len(data.val_labels), (1000, 4), generator=torch.Generator().manual_seed(99))
    _, label = data.compose(data.val_images, data.val_labels, idx)
    total = 0.0
    for row, y in zip(data.val_labels[idx[:, 1:]].tolist(), label.tolist()):
        counts = {c: row.count(c) for c in row}
        best = [c for c in counts if counts[c] == max(counts.values())]
        total += sum(c == y for c in best) / len(best)
    assert eureka.blind_accuracy(data) == pytest.approx(total / 1000, abs=1e-12)
    assert 0.38 < total / 1000 < 0.48  # about 1/3 plus repeated classes


def test_accuracy_jump():
    evals = [(s, 0.0, 0.42) for s in range(0, 500, 20)] + [(500, 0.0, 0.6), (520, 0.0, 0.8)] + \
        [(s, 0.0, 0.9) for s in range(540, 700, 20)]
    step, threshold = eureka.accuracy_jump(evals, blind=0.43)
    assert threshold == pytest.approx((0.43 + 0.9) / 2) and step == 520
    assert eureka.accuracy_jump([(s, 0.0, 0.45) for s in range(0, 500, 20)], blind=0.43)[0] is None


def test_a_run_cut_off_during_its_jump_has_not_settled():
    """A run cut off during its jump (as vit-lr0.001-s130): the accuracy still rises from 0.58 to 0.72 over the
    last 100 steps, so "halfway to the final accuracy" (the jump's date, 1900) is halfway to a point on the way
    up. A jump that finished 100 steps before the end has settled."""
    plateau = [(s, 0.0, 0.42) for s in range(0, 1860, 20)]
    cut = {"blind": 0.433, "evals": plateau + [(1860, 0.0, 0.489), (1880, 0.0, 0.529), (1900, 0.0, 0.579),
                                               (1920, 0.0, 0.623), (1940, 0.0, 0.638), (1960, 0.0, 0.691),
                                               (1980, 0.0, 0.698), (1999, 0.0, 0.72)]}
    assert accuracy_jump(cut) == 1900 and not settled(cut)
    done = {"blind": 0.433, "evals": [(s, 0.0, 0.42) for s in range(0, 1500, 20)] + [(1500, 0.0, 0.7)]
            + [(s, 0.0, 0.95 + 0.01 * (s % 40 == 0)) for s in range(1520, 2000, 20)]}
    assert accuracy_jump(done) == 1500 and settled(done)
    assert settled({"blind": 0.4, "evals": [(0, 0.0, 0.4), (20, 0.0, 0.9)]})  # too short to tell: settled


def test_the_accuracy_jump_is_also_judged_as_the_span_it_takes():
    """On the consulted Eureka runs the accuracy takes 3-15 evaluation intervals to rise from a quarter to three
    quarters of the way up; the span is the first evaluations above those lines."""
    rise = [(500 + 20 * i, 0.0, 0.43 + 0.05 * i) for i in range(1, 10)]  # 0.48 at 520 .. 0.88 at 680
    info = {"blind": 0.43, "evals": [(s, 0.0, 0.42) for s in range(0, 520, 20)] + rise
            + [(s, 0.0, 0.92) for s in range(700, 2000, 20)]}
    # halfway to the final 0.92: 0.675 (0.68 at 600); a quarter: 0.5525 (0.58 at 560); three quarters: 0.7975
    # (0.83 at 660)
    assert accuracy_jump(info) == 600 and accuracy_rise(info) == (560, 660)
    assert accuracy_rise(info, 0.5, 0.5) == (600, 600)  # halfway both: the jump's date
    assert accuracy_rise({"blind": 0.43, "evals": [(s, 0.0, 0.45) for s in range(0, 500, 20)]}) is None


def test_an_attention_state_alert_is_checked_against_the_logged_attention(monkeypatch):
    """A head-level alert on a healthy run is a true one when the ground truth (the states of the run's logged
    attention) has that head in that state; another head, or another state, is not."""
    import evaluation.detectors as judge
    from diag.detectors.base import Alert
    from diag.detectors.states import StateEpisode

    episodes = [StateEpisode("malignant", "L02/H03", 960, 970, None)]
    monkeypatch.setattr(judge, "states", lambda run, cfg=None: episodes)
    run = Run(RunSpec("hf", 0, 1e-3, 20, model="vit"), Path("."), {})
    assert judge.in_state(run, Alert(970, "malignant_collapse", "warning", "L02/H03", ""))
    assert not judge.in_state(run, Alert(970, "malignant_collapse", "warning", "L02/H01", ""))
    assert not judge.in_state(run, Alert(970, "uniform_attention", "warning", "L02/H03", ""))
    assert not judge.in_state(run, Alert(970, "collapse_damage", "critical", "L02", ""))
    # a record that two heads share is true when both are in the state (Alert.heads)
    both = Alert(970, "malignant_collapse", "warning", "L02/H01+H03", "", heads=("L02/H01", "L02/H03"))
    assert not judge.in_state(run, both)
    episodes.append(StateEpisode("malignant", "L02/H01", 960, 970, None))
    assert judge.in_state(run, both)


def test_normsoftmax_attention_against_a_per_head_loop():
    torch.manual_seed(0)
    cfg = eureka.EurekaConfig(attention="normsoftmax", temperature=0.5)
    attn = eureka.ViTAttention(cfg).double()
    x = torch.randn(2, 17, cfg.n_embd, dtype=torch.float64)
    wq, wk, wv = attn.c_attn.weight.split(cfg.n_embd)
    bq, bk, bv = attn.c_attn.bias.split(cfg.n_embd)
    d = cfg.n_embd // cfg.n_head
    heads = []
    for h in range(cfg.n_head):
        sl = slice(h * d, (h + 1) * d)
        q, k, v = x @ wq[sl].T + bq[sl], x @ wk[sl].T + bk[sl], x @ wv[sl].T + bv[sl]
        s = q @ k.transpose(1, 2) / math.sqrt(d)  # (B, T, T)
        z = s / (0.5 * s.std(dim=-1, keepdim=True, unbiased=True) + 1e-6)
        heads.append(torch.softmax(z, dim=-1) @ v)
    reference = attn.c_proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(attn(x), reference, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attention", ["softmax", "normsoftmax"])
def test_short_eureka_run_is_monitored(attention):
    cfg = eureka.EurekaConfig(attention=attention, steps=60, batch_size=64, eval_every=30, seed=0)
    run = eureka.train(cfg)
    assert [layer.adapter for layer in (lay.layout for lay in run.monitor.layers)] == ["nanogpt-c_attn"] * 2
    tags = set().union(*(r.scalars for r in run.memory.records))
    for tag in ("attn_entropy/L01/H03", "qk_sigma1/L00/H00", "grad_ratio_qk_v/L00", "update_ratio_q/L01", "loss"):
        assert tag in tags, f"{tag} not logged"
    assert run.losses[0] > 2.0 and np.mean(run.losses[-10:]) < run.losses[0] - 0.3  # it learns
    ratio = dict(eureka.layer_mean_series(run.memory, "grad_ratio_qk_v"))
    # Hoffmann et al.: softmax attention starts with Q/K gradients far below V's; NormSoftmax closes the gap
    if attention == "softmax":
        assert ratio[0] < 0.2
    else:
        assert ratio[0] > 0.4
    assert not [a for a in run.monitor.alert_sink.history if a.level != "info"]


def test_a_plan_runs_multi_threaded_runs_with_fewer_processes():
    """The rounding replicas (2 torch threads) go in their own group, one process at a time on 2 jobs."""
    from evaluation.plan import groups
    from evaluation.seeds import SETS

    out = groups(SETS["report"], 2)
    assert [(jobs, {s.threads for s in specs}) for jobs, specs in out] == [(2, {1}), (1, {2})]
    assert sum(len(specs) for _, specs in out) == len(SETS["report"])
    assert len(out[1][1]) == 20  # the 20 replicas at the boundary


def test_a_claim_whose_recorder_is_gone_is_taken_over_and_a_living_one_is_not(tmp_path):
    """A killed recording leaves its ``.claim`` behind: the claim holds its process id, so a dead one's is taken
    over, and a living one's or an unreadable one says which file to look at (never a run reported as recorded
    while it is skipped)."""
    import os
    import subprocess
    import sys

    from evaluation.runs import Claimed, claim

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / ".claim").write_text(gone)
    claim(tmp_path)
    assert (tmp_path / ".claim").read_text() == str(os.getpid())
    with pytest.raises(Claimed, match=f"being recorded by process {os.getpid()}"):
        claim(tmp_path)  # this process lives
    (tmp_path / ".claim").write_text("")
    with pytest.raises(Claimed, match=r"names no process .* remove it if no plan is recording"):
        claim(tmp_path)


def test_a_plateau_alert_at_the_context_free_loss_is_not_scored_false_when_tuning():
    from evaluation.tune import plateau_score

    hf = {"kind": "hf", "twin": "", "plateau_alerts": 1, "plateau_real": False}
    eureka = {"kind": "eureka", "jump": 700, "plateau_in_time": True}
    assert plateau_score([eureka, {**hf, "context_free": False}]) == (-1, 1, 1)
    assert plateau_score([eureka, {**hf, "context_free": True}]) == (1, 1, 0)  # stuck: no healthy run
    assert plateau_score([eureka, {**hf, "context_free": True, "twin": "normsoftmax"}]) == (1, 1, 0)


def test_the_context_free_loss_is_the_entropy_of_the_corpus_bytes_and_a_plateau_at_it_is_stuck():
    import collections

    from evaluation.truth import CONTEXT_FREE_MARGIN, at_context_free, context_free_loss
    from hooks.demo import load_text

    data = load_text().encode()
    counts = collections.Counter(data)
    direct = -sum(c / len(data) * math.log(c / len(data)) for c in counts.values())
    assert context_free_loss() == pytest.approx(direct, rel=1e-9)
    h = context_free_loss()

    def run(model: str, losses: list[float]) -> Run:
        return Run(RunSpec("hf", 0, 1e-3, len(losses), model=model), Path("."), {"losses": losses})

    edge = (1 - CONTEXT_FREE_MARGIN) * h
    assert at_context_free(run("bert", [5.0] * 100 + [h] * 200), 300)
    assert at_context_free(run("gpt2", [5.0] * 100 + [edge + 1e-9] * 200), 300)
    assert not at_context_free(run("gpt2", [5.0] * 100 + [edge - 1e-3] * 200), 300)
    assert not at_context_free(run("bert", [h] * 200 + [0.8 * h] * 100), 300)  # the 100 steps before it count
    assert at_context_free(run("bert", [h] * 200 + [0.8 * h] * 100), 200)
    assert at_context_free(run("vit", [h] * 300), 300) is None  # classes, not bytes: no such level


# ------------------------------------------------------------------ a collapse, end to end


@pytest.fixture(scope="module")
def collapse_and_twin(tmp_path_factory):
    """The reproduction's GPT without warmup at lr 7e-3 (seed 1), and its QK-norm twin, recorded at every step as
    the evaluation records them (one torch thread: the run's rounding is the evaluation's)."""
    from evaluation.lm import train_spec
    from evaluation.truth import load_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {}
        for twin in ("", "qknorm"):
            spec = RunSpec("lm", 1, 7e-3, 300, twin=twin)
            out = tmp_path_factory.mktemp(spec.name)
            info = train_spec(spec, out)
            (out / "run.json").write_text(json.dumps({"config": asdict(spec), **info}))
            runs[twin or "plain"] = load_run(out)
    finally:
        torch.set_num_threads(threads)
    return runs["plain"], runs["qknorm"]


def test_a_reproduced_collapse_is_warned_before_its_damage_and_its_twin_is_not(collapse_and_twin):
    """The plain run's loss ends clearly above its QK-norm twin's (the twin test: damaged, from some step on), a
    layer of it collapses by the evaluation's own ground truth, and the detectors at the Monitor's default cadence
    (evaluation.detectors.replay) raise a collapse record on that layer (a malignant_collapse or collapse_damage)
    before the damage begins. The twin, undamaged, gets none of them."""
    from diag.detectors import AlertConfig
    from evaluation.detectors import replay
    from evaluation.truth import onsets

    run, twin = collapse_and_twin
    damaged, begins = damage(run, twin)
    assert damaged and begins is not None
    layer_onsets = onsets(run)
    assert layer_onsets, "the reproduction's attention collapses"
    kinds = ("malignant_collapse", "collapse_damage")
    alerts = [a for a in replay(run.obs, AlertConfig(), "default", run.losses)
              if a.kind in kinds and a.status == "firing" and a.level != "info"]
    first = min((a.step for a in alerts if a.where.split("/")[0] in layer_onsets), default=None)
    assert first is not None and first < begins, (first, begins, layer_onsets)
    twin_alerts = [a for a in replay(twin.obs, AlertConfig(), "default", twin.losses)
                   if a.kind in kinds and a.level != "info"]
    assert damage(twin, run)[0] is False and twin_alerts == []
