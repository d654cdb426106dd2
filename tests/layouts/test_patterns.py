"""Spec patterns: one helper for matching and for every pattern a message suggests."""

from __future__ import annotations

from torch import nn

from diag.layouts.patterns import first_match, generalise, matches, patterns_for
from diag.layouts.vocab import QKVLayout


def test_index_components_become_stars_and_nothing_else():
    assert generalise("model.layers.12.self_attn") == "model.layers.*.self_attn"
    assert generalise("0.attn") == "*.attn" and generalise("h2o.1") == "h2o.*" and generalise("layer10") == "layer10"


def test_a_pattern_that_would_take_feed_forward_blocks_too_falls_back_to_exact_names():
    """nn.Sequential blocks: 'layers.*.*' would select each block's feed-forward child as well."""
    model = nn.Module()
    model.layers = nn.Sequential(*(nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8)) for _ in range(2)))
    names = [n for n, _ in model.named_modules()]
    targets = ["layers.0.0", "layers.1.0"]
    chosen = patterns_for(targets, names)
    assert chosen == targets
    selected = {n for n in names if any(matches(n, p) for p in chosen)}
    assert selected == set(targets)


def test_modules_inside_a_target_do_not_block_a_pattern():
    """'blocks.*' also matches 'blocks.0.out', but discovery never searches inside a found module."""
    names = ["", "blocks", "blocks.0", "blocks.0.out", "blocks.1", "blocks.1.out"]
    assert patterns_for(["blocks.0", "blocks.1"], names) == ["blocks.*"]


def test_first_match_never_selects_the_root_and_takes_the_first_pattern():
    a, b = QKVLayout(2, 4, "w", packing="fused"), QKVLayout(4, 2, "w", packing="fused")
    spec = {"blocks.*": a, "blocks.0": b}
    assert first_match("blocks.0", spec) is a and first_match("", {"*": a}) is None
