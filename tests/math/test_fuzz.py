"""Checkpoint loaders and the CLI on hostile input (hypothesis).

Arbitrary bytes, truncations, bit flips and spliced bytes of real small ``.pt``,
``.safetensors``, sharded ``*.index.json`` and ``config.json`` files; state dicts with
wrong dtypes and shapes. ``open_checkpoint`` either succeeds or raises a
:class:`~diag.errors.DiagError` whose message names the path; ``analyze_checkpoints``
never raises and names the path in each failure; ``python -m diag analyze`` exits
0, 1 or 2 within a timeout, with no traceback. Examples are kept few: the file runs
in well under a minute on two shared cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from diag.errors import DiagError
from diag.offline.checkpoint import open_checkpoint
from diag.offline.series import analyze_checkpoints

# DIAG_FUZZ_EXAMPLES=1000 for a longer hunt (about a minute per 1000 examples of each test).
FUZZ = settings(
    max_examples=int(os.environ.get("DIAG_FUZZ_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)

E, HEADS = 8, 2


def _state() -> dict[str, torch.Tensor]:
    """A one-block nanoGPT-like state dict: small, and a layout the analysis recognises."""
    gen = torch.Generator().manual_seed(0)
    return {
        "h.0.attn.c_attn.weight": torch.randn(3 * E, E, generator=gen),
        "h.0.attn.c_attn.bias": torch.randn(3 * E, generator=gen),
        "h.0.attn.c_proj.weight": torch.randn(E, E, generator=gen),
        "h.1.attn.c_attn.weight": torch.randn(3 * E, E, generator=gen),
        "h.1.attn.c_attn.bias": torch.randn(3 * E, generator=gen),
        "h.1.attn.c_proj.weight": torch.randn(E, E, generator=gen),
    }


def _originals() -> dict[str, bytes]:
    """The bytes of a real file of every kind, written once."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        state = _state()
        torch.save({"model": state, "model_args": {"n_head": HEADS, "n_embd": E}, "iter_num": 5}, tmp / "a.pt")
        save_file(state, str(tmp / "a.safetensors"), metadata={"step": "5"})
        save_file(state, str(tmp / "b.safetensors"), metadata={"step": "\u00b2"})  # isdigit(), yet not int()
        torch.save({0: state["h.0.attn.c_attn.weight"], 1: torch.ones(2)}, tmp / "c.pt")
        return {
            ".pt": (tmp / "a.pt").read_bytes(),
            ".safetensors": (tmp / "a.safetensors").read_bytes(),
            "index.json": json.dumps({"metadata": {}, "weight_map": {k: "a.safetensors" for k in state}}).encode(),
            "config.json": json.dumps(
                {"model_type": "gpt2", "n_head": HEADS, "n_embd": E, "architectures": ["GPT2LMHeadModel"]}
            ).encode(),
            # not mutated, only for the CLI cases
            "superscript-step.safetensors": (tmp / "b.safetensors").read_bytes(),
            "int-keys.pt": (tmp / "c.pt").read_bytes(),
        }


ORIGINALS = _originals()
KINDS = [".pt", ".safetensors", "index.json", "config.json"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
STEP_TEXT = st.sampled_from(["5", " 7 ", "\u00b2", "\u0663", "9" * 5000, "-1", "1e3", ""]) | st.text(max_size=6)


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    """(kind, bytes): one real file, then arbitrary bytes, a truncation, bit flips or spliced bytes."""
    kind = draw(st.sampled_from(KINDS))
    data = ORIGINALS[kind]
    how = draw(st.sampled_from(["arbitrary", "truncate", "flip", "splice", "as-is"]))
    if how == "arbitrary":
        data = draw(st.binary(max_size=600))
    elif how == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "flip":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            # half of the flips in the first 512 bytes: headers, where parsing happens
            pos = draw(st.integers(0, min(511, len(buf) - 1)) | st.integers(0, len(buf) - 1))
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        data = bytes(buf)
    elif how == "splice":
        pos = draw(st.integers(0, len(data)))
        data = data[:pos] + draw(st.binary(min_size=1, max_size=64)) + data[pos + draw(st.integers(0, 64)) :]
    return kind, data


def _layout(folder: Path, kind: str, data: bytes) -> Path:
    """Write the mutated file where its kind lives; the other files of the checkpoint intact."""
    if kind == ".pt":
        path = folder / "ckpt_5.pt"
        path.write_bytes(data)
        return path
    if kind == ".safetensors":
        path = folder / "ckpt_5.safetensors"
        path.write_bytes(data)
        return path
    if kind == "index.json":
        (folder / "a.safetensors").write_bytes(ORIGINALS[".safetensors"])
        path = folder / "model.safetensors.index.json"
        path.write_bytes(data)
        return path
    model = folder / "model"  # a Hugging Face model folder with a mutated config.json
    model.mkdir()
    (model / "model.safetensors").write_bytes(ORIGINALS[".safetensors"])
    (model / "config.json").write_bytes(data)
    return model


def _check_open(path: Path) -> None:
    try:
        ckpt = open_checkpoint(path)
    except DiagError as err:
        assert str(path) in str(err), f"the message does not name the path: {err}"
        return
    assert isinstance(ckpt.tensors.shapes, dict)


def _check_analyze(path: Path) -> None:
    analysis = analyze_checkpoints([path], heads=None)  # must not raise, whatever the bytes
    for failed, message in analysis.failures:
        assert message.strip() and "\n" not in message.strip(), message
        assert failed == str(path) and str(path) in message, message
    assert analysis.analysed or analysis.failures


@FUZZ
@given(mutated())
def test_corrupt_files_raise_only_diag_errors_naming_the_path(case):
    kind, data = case
    with tempfile.TemporaryDirectory() as tmp:
        path = _layout(Path(tmp), kind, data)
        _check_open(path)
        _check_analyze(path)


# ------------------------------------------------------------ wrong dtypes and shapes

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@st.composite
def odd_state(draw) -> dict[str, torch.Tensor]:
    """Attention-like names with arbitrary (small) shapes and dtypes, some empty or 0-d."""
    names = [
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_attn.bias",
        "h.0.attn.c_proj.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "enc.in_proj_weight",
    ]
    state = {}
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=6, unique=True)):
        shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 6, 8, 12, 24]), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        value = (
            torch.zeros(shape)
            if draw(st.booleans())
            else torch.full(shape, draw(st.sampled_from([1.0, -2.5, float("nan"), float("inf"), 1e30])))
        )
        state[name] = value.to(dtype)
    return state


_ATTN = "layers.0.self_attn."


@FUZZ
@given(odd_state(), st.sampled_from([".pt", ".safetensors"]), st.none() | st.integers(1, 5))
# empty Q/K rows make a head width of 0, which the separate projections' adapter and the grouped-query hint
# must not divide by (a ZeroDivisionError, not a clean error)
@example({f"{_ATTN}q_proj.weight": torch.zeros(1, 0), f"{_ATTN}k_proj.weight": torch.zeros(0, 0),
          f"{_ATTN}v_proj.weight": torch.zeros(0, 0), f"{_ATTN}o_proj.weight": torch.tensor(1.0)}, ".pt", None)
@example({f"{_ATTN}q_proj.weight": torch.zeros(0, 0), f"{_ATTN}k_proj.weight": torch.zeros(0, 0),
          f"{_ATTN}v_proj.weight": torch.zeros(0, 0), f"{_ATTN}o_proj.weight": torch.tensor(1.0)}, ".pt", None)
@example({f"{_ATTN}q_proj.weight": torch.zeros(1, 0), f"{_ATTN}k_proj.weight": torch.zeros(0, 0),
          f"{_ATTN}v_proj.weight": torch.tensor(1.0)}, ".pt", None)
def test_wrong_dtypes_and_shapes_fail_cleanly(state, suffix, heads):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"odd{suffix}"
        if suffix == ".pt":
            torch.save(state, path)
        else:
            save_file({k: v.contiguous() for k, v in state.items() if v.dtype != torch.complex64}, str(path))
        _check_open(path)
        analysis = analyze_checkpoints([path], heads=heads)
        for _, message in analysis.failures:
            assert str(path) in message, message


@FUZZ
@given(
    JSON,
    st.sampled_from(
        [
            "n_head",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "d_kv",
            "decoder_attention_heads",
            "model_type",
            "architectures",
        ]
    ),
)
def test_config_values_of_any_json_type_fail_cleanly(value, key):
    config = {"model_type": "gpt2", "n_head": HEADS, "n_embd": E}
    config[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = _layout(Path(tmp), "config.json", json.dumps(config).encode())
        _check_open(path)
        _check_analyze(path)


@FUZZ
@given(JSON, st.sampled_from(["weight_map", "document", "trainer_state"]))
def test_index_and_trainer_state_of_any_json_shape_fail_cleanly(value, where):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "a.safetensors").write_bytes(ORIGINALS[".safetensors"])
        if where == "trainer_state":
            (folder / "config.json").write_bytes(ORIGINALS["config.json"])
            (folder / "model.safetensors").write_bytes(ORIGINALS[".safetensors"])
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": value} if value else value))
            path = folder
        else:
            path = folder / "model.safetensors.index.json"
            path.write_text(json.dumps({"weight_map": value} if where == "weight_map" else value))
        _check_open(path)
        _check_analyze(path)


@FUZZ
@given(
    STEP_TEXT,
    st.dictionaries(
        st.sampled_from(["step", "iter_num", "global_step", "model_args", "config", 0, 1.5, "optimizer", "model"]),
        JSON
        | st.just(torch.ones(2))
        | st.just(torch.tensor(3))
        | st.just(torch.tensor(1.5))
        | st.just({"n_head": HEADS})
        | STEP_TEXT,
        max_size=4,
    ),
)
def test_stored_steps_and_containers_of_any_type_fail_cleanly(step_text, extra):
    """Steps in safetensors metadata (text) and .pt containers (anything a weights-only pickle holds)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_file(_state(), str(tmp / "a.safetensors"), metadata={"step": step_text})
        container = {"model": _state(), **extra}
        torch.save(container, tmp / "b.pt")
        torch.save({k if isinstance(k, str) else k: v for k, v in extra.items()} or {0: torch.ones(1)}, tmp / "c.pt")
        for path in (tmp / "a.safetensors", tmp / "b.pt", tmp / "c.pt"):
            _check_open(path)
            _check_analyze(path)
        analysis = analyze_checkpoints([tmp])  # the three as a series: ordering by stored steps
        assert analysis.analysed or analysis.failures


# ------------------------------------------------------------------------- the CLI

CLI_CASES = {
    "garbage.pt": b"\x80\x04garbage that is not a pickle",
    "zip-truncated.pt": ORIGINALS[".pt"][: len(ORIGINALS[".pt"]) // 2],
    "empty.safetensors": b"",
    "huge-header.safetensors": (1 << 62).to_bytes(8, "little") + b"{}",
    "bad-header.safetensors": (40).to_bytes(8, "little") + b'{"x": {"dtype": "F32", "shape": [99999999]}}',
    "index.json": b'{"weight_map": {"a": "../../../../etc/passwd"}}',
    "int-shard.index.json": b'{"weight_map": {"h.0.attn.c_attn.weight": 5, "b": ["x"]}}',
    "int-keys.pt": ORIGINALS["int-keys.pt"],
    "superscript-step.safetensors": ORIGINALS["superscript-step.safetensors"],
    "flipped.safetensors": bytes(b ^ 0xFF if i in (9, 20, 33) else b for i, b in enumerate(ORIGINALS[".safetensors"])),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_on_corrupt_files_exits_with_a_documented_code(name, tmp_path):
    path = tmp_path / name
    path.write_bytes(CLI_CASES[name])
    proc = subprocess.run(
        [sys.executable, "-m", "diag", "analyze", str(path), "--out", str(tmp_path / "out"), "--quiet", "--no-report"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode in (0, 1, 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode:
        assert f"error: {path}" in proc.stderr or str(path) in proc.stderr, proc.stderr


# ---------------------------------------------------------------------- --probe

PROBE_CONFIGS = {
    "unknown-model-type": {"model_type": "evil"},
    "model-type-list": {"model_type": ["gpt2"]},
    "layers-text": {"n_layer": "x"},
    "negative-width": {"n_embd": -4},
    "architectures-dict": {"architectures": {"a": 1}},
    "architectures-text": {"architectures": "GPT2LMHeadModel"},
    "no-model-type": {"model_type": None},
}


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    from tests.support import zoo

    folder = tmp_path_factory.mktemp("probe") / "checkpoint-3"
    zoo.gpt2(dropout=0.0).model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", list(PROBE_CONFIGS) + ["ids-out-of-vocabulary"])
def test_probe_on_a_hostile_config_fails_the_probe_only(name, gpt2_folder, tmp_path):
    """--probe builds a model from config.json: whatever is in it, the probe fails with a ProbeError
    naming the path, and the weight-side metrics of the checkpoint are still there."""
    from hooks.checkpoint.probe import Probe

    folder = tmp_path / "checkpoint-3"
    shutil.copytree(gpt2_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(PROBE_CONFIGS.get(name, {}))
    (folder / "config.json").write_text(json.dumps(config))
    (tmp_path / "ids.txt").write_text("1 2 999999 3\n" if name == "ids-out-of-vocabulary" else "1 2 3 4\n")
    analysis = analyze_checkpoints([folder], probe=Probe(tmp_path / "ids.txt"))
    assert analysis.analysed == [(str(folder), 3)]  # the weights were analysed
    assert len(analysis.failures) == 1
    assert analysis.failures[0][1].startswith(f"{folder}: probe: "), analysis.failures
    assert "qk_sigma1/L00/H00" in analysis.records[0].scalars
