"""Checkpoint analysis: every format, written here from tiny zoo models, against the live Monitor."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from diag.cli.main import main
from diag.offline.checkpoint import CheckpointError, open_checkpoint
from diag.offline.series import analyze_checkpoints
from diag.outputs.sinks import MemorySink
from hooks.monitor.monitor import Monitor
from tests.support import zoo

WEIGHT_TAGS = ("qk_sigma1", "qk_sec", "qk_erank", "qk_stable_rank")


def _plain(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _live_scalars(model: torch.nn.Module) -> dict[str, float]:
    """What the live Monitor logs for the weight spectra of ``model`` at one step."""
    mem = MemorySink()
    with Monitor(model, every=1, sinks=[mem], signals=("spectra",)) as monitor:
        monitor.step(0)
    return {t: v for t, v in mem.records[0].scalars.items() if t.startswith(WEIGHT_TAGS)}


def _offline_scalars(paths, **kwargs) -> dict[str, float]:
    analysis = analyze_checkpoints([str(p) for p in paths], **kwargs)
    assert not analysis.failures, analysis.failures
    return {t: v for t, v in analysis.records[0].scalars.items() if t.startswith(WEIGHT_TAGS)}


def _assert_same(live: dict[str, float], offline: dict[str, float]) -> None:
    assert sorted(live) == sorted(offline)
    for tag, value in live.items():
        assert offline[tag] == pytest.approx(value, rel=1e-6, abs=1e-12), tag


def _write_sharded(state: dict[str, torch.Tensor], folder) -> None:
    folder.mkdir()
    keys = list(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, str(folder / name))
    weight_map = {k: name for name, part in shards.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --------------------------------------------------------------- every format


def _pt(case, tmp_path):
    torch.save(_plain(case.model), tmp_path / "model.pt")
    return tmp_path / "model.pt", {"heads": 4}


def _container_model(case, tmp_path):
    torch.save({"model": _plain(case.model), "optimizer": {}, "epoch": 3}, tmp_path / "ckpt.pth")
    return tmp_path / "ckpt.pth", {"heads": 4}


def _ddp_state_dict(case, tmp_path):
    state = {f"module.{k}": v for k, v in _plain(case.model).items()}
    torch.save({"state_dict": state}, tmp_path / "ddp.ckpt")
    return tmp_path / "ddp.ckpt", {"heads": 4, "kv_heads": 2}


def _nanogpt_compiled(case, tmp_path):
    state = {f"_orig_mod.{k}": v for k, v in _plain(case.model).items()}
    args = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 64, "bias": True, "vocab_size": zoo.VOCAB}
    torch.save({"model": state, "model_args": args, "iter_num": 7, "best_val_loss": torch.tensor(3.0)},
               tmp_path / "ckpt.pt")
    return tmp_path / "ckpt.pt", {}


def _legacy_bin(case, tmp_path):
    torch.save(_plain(case.model), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    return tmp_path / "pytorch_model.bin", {"heads": 4}


def _safetensors(case, tmp_path):
    save_file(_plain(case.model), str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors", {"heads": 4}


def _sharded(case, tmp_path):
    _write_sharded(_plain(case.model), tmp_path / "sharded")
    return tmp_path / "sharded" / "model.safetensors.index.json", {"heads": 4, "kv_heads": 2}


def _hf_folder(case, tmp_path):
    case.model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", {}


FORMATS = {
    "pt-state-dict": ("nanogpt", _pt),
    "container-model": ("gpt2-eager", _container_model),
    "state_dict-module-prefix": ("llama-eager", _ddp_state_dict),
    "nanogpt-orig_mod-model_args": ("nanogpt", _nanogpt_compiled),
    "legacy-bin": ("torch-encoder", _legacy_bin),
    "safetensors": ("torch-encoder", _safetensors),
    "sharded-safetensors": ("llama-eager", _sharded),
    "hf-folder-gpt2": ("gpt2-eager", _hf_folder),
    "hf-folder-llama-gqa": ("llama-eager", _hf_folder),
}


@pytest.mark.parametrize("family", ["bart", "t5", "bert", "gpt-neox", "mistral"])
def test_hf_families_offline_match_live_tags_and_values(family, tmp_path):
    """Encoder-decoder labels (L02.cross) and per-head packings agree between live and offline."""
    case = zoo.FAMILY_BUILDERS[family]()
    path, kwargs = _hf_folder(case, tmp_path)
    live = _live_scalars(case.model)
    if family in ("bart", "t5"):
        assert any(".cross/" in tag for tag in live)
    _assert_same(live, _offline_scalars([path], **kwargs))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_gives_the_live_monitors_spectra(fmt, tmp_path):
    model_name, write = FORMATS[fmt]
    case = zoo.CASES[model_name]()
    path, kwargs = write(case, tmp_path)
    _assert_same(_live_scalars(case.model), _offline_scalars([path], **kwargs))


def test_a_weights_file_uses_the_config_beside_it(tmp_path):
    case = zoo.llama()
    case.model.save_pretrained(tmp_path / "hf")
    analysis = analyze_checkpoints([tmp_path / "hf" / "model.safetensors"])
    assert analysis.heads.source == "config.json"
    assert [(la.layout.n_heads, la.layout.kv_heads) for la in analysis.layers] == [(4, 2), (4, 2)]


def test_the_core_never_imports_hooks_and_the_command_runs(tmp_path):
    torch.save(_plain(zoo.nanogpt().model), tmp_path / "step_3.pt")
    code = ("import sys; from diag.cli.main import main; import diag.offline.series, diag.reports.checkpoints; "
            "assert 'hooks' not in sys.modules; "
            f"sys.exit(main(['analyze', {str(tmp_path / 'step_3.pt')!r}, '--out', {str(tmp_path / 'out')!r}, "
            "'--heads', '4', '--json', '--no-report']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["checkpoints"][0]["step"] == 3


def test_stored_step_and_config_heads(tmp_path):
    path, _ = _nanogpt_compiled(zoo.nanogpt(), tmp_path)
    ckpt = open_checkpoint(path)
    assert ckpt.stored_step == 7 and ckpt.config_source == "model_args"
    assert all(not k.startswith("_orig_mod.") for k in ckpt.tensors.shapes)
    analysis = analyze_checkpoints([path])
    assert analysis.steps == [7] and analysis.heads.source == "model_args"
    assert [la.layout.n_heads for la in analysis.layers] == [4, 4]


def test_without_head_count_each_layer_is_one_head(tmp_path):
    case = zoo.nanogpt()
    torch.save(_plain(case.model), tmp_path / "model.pt")
    analysis = analyze_checkpoints([tmp_path / "model.pt"])
    assert analysis.heads.source == "assumed" and "one head" in analysis.heads.note
    w = case.model.h[0].attn.c_attn.weight.detach().double()
    wq, wk = w[:32], w[32:64]
    sigma = torch.linalg.svdvals(wq.T @ wk)[0].item()
    assert analysis.records[0].scalars["qk_sigma1/L00/H00"] == pytest.approx(sigma, rel=1e-9)


# --------------------------------------------------------------- bad input


class _WouldCreateAFile:
    def __init__(self, target) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))  # unpickling this would create the file


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_pickle_with_code_is_refused_and_never_run(writer, tmp_path, capsys):
    target = tmp_path / "pwned.txt"
    payload = {"w": torch.zeros(2, 2), "evil": _WouldCreateAFile(target)}
    path = tmp_path / "evil.pt"
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    with pytest.raises(CheckpointError, match="refused"):
        open_checkpoint(path)
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"refused: {path} holds pickled code" in err and "weights-only" in err
    assert not target.exists()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_truncated_file_is_one_clear_line(suffix, tmp_path, capsys):
    whole, cut = tmp_path / f"whole{suffix}", tmp_path / f"cut{suffix}"
    state = _plain(zoo.nanogpt().model)
    torch.save(state, whole) if suffix == ".pt" else save_file(state, str(whole))
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert main(["analyze", str(cut), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert lines[0] == f"error: {cut}: " + lines[0].split(": ", 2)[2] and "truncated or corrupt" in lines[0]


@pytest.mark.parametrize("case", ["missing", "empty-folder", "unknown-layout", "not-a-state-dict"])
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    path = tmp_path / "input"
    expected = {"missing": "no such file or folder", "empty-folder": "holds no checkpoint",
                "unknown-layout": "unknown layout", "not-a-state-dict": "not a state dict"}[case]
    if case == "empty-folder":
        path.mkdir()
    elif case == "unknown-layout":
        path = tmp_path / "mlp.pt"
        torch.save(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)).state_dict(), path)
    elif case == "not-a-state-dict":
        path = tmp_path / "list.pt"
        torch.save([torch.zeros(2)], path)
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert expected in err[0] and str(path) in err[0]
    assert err[-1] == "error: nothing analysed; see the errors above"


def test_mismatched_shapes_in_a_series_fail_that_checkpoint(tmp_path, capsys):
    torch.save(_plain(zoo.nanogpt().model), tmp_path / "step_1.pt")
    torch.save(_plain(zoo.NanoGPT(n_embd=16, n_head=4)), tmp_path / "step_2.pt")
    assert main(["analyze", str(tmp_path), "--heads", "4", "--out", str(tmp_path / "out"), "--quiet"]) == 1
    assert "step_2.pt: mismatched shapes" in capsys.readouterr().err


# --------------------------------------------------------------- series


def _train_series(case, folder, steps: int) -> MemorySink:
    """Train with the live Monitor (every=1), saving the weights each step saw, plus the final ones."""
    folder.mkdir()
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    mem = MemorySink()
    with Monitor(case.model, every=1, sinks=[mem], signals=("spectra", "updates")) as monitor:
        for step in range(steps):
            case.loss(case.model, case.make_batch(gen)).backward()
            torch.save(_plain(case.model), folder / f"ckpt_step{step}.pt")
            monitor.step(step)
            opt.step()
            opt.zero_grad()
    torch.save(_plain(case.model), folder / f"ckpt_step{steps}.pt")
    return mem


def _jsonl(path) -> dict[tuple[int, str], float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {(r["step"], r["tag"]): r["value"] for r in rows}


@pytest.mark.parametrize("model_name, heads", [("nanogpt", ["--heads", "4"]),
                                               ("llama-eager", ["--heads", "4", "--kv-heads", "2"])])
def test_series_reproduces_the_live_monitor(model_name, heads, tmp_path, capsys):
    steps = 3
    mem = _train_series(zoo.CASES[model_name](), tmp_path / "ckpts", steps)
    out = tmp_path / "out"
    assert main(["analyze", str(tmp_path / "ckpts"), "--out", str(out), "--quiet", *heads]) == 0
    offline = _jsonl(out / "metrics.jsonl")
    live = {(r.step, tag): v for r in mem.records for tag, v in r.scalars.items()}
    compared = [key for key in live if key[1].startswith(WEIGHT_TAGS + ("update_ratio", "update_fro"))]
    assert len(compared) > 20 and {s for s, _ in compared} == set(range(steps))
    assert {(s, f"update_{m}_o/L0{i}") for s in range(steps) for m in ("ratio", "fro") for i in (0, 1)} <= set(compared)
    for key in compared:
        assert offline[key] == pytest.approx(live[key], rel=1e-6, abs=1e-12), key
    assert {s for s, t in offline if t.startswith("update_")} == set(range(steps))  # none at the last checkpoint
    assert {s for s, t in offline if t.startswith("qk_")} == set(range(steps + 1))


def test_series_with_a_corrupt_checkpoint_analyses_the_others(tmp_path, capsys):
    folder = tmp_path / "ckpts"
    _train_series(zoo.nanogpt(), folder, 3)
    (folder / "ckpt_step2.pt").write_bytes(b"not a checkpoint")
    out = tmp_path / "out"
    assert main(["analyze", str(folder), "--heads", "4", "--out", str(out), "--json"]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert [c["step"] for c in summary["checkpoints"]] == [0, 1, 3]
    assert [f["path"] for f in summary["failures"]] == [str(folder / "ckpt_step2.pt")]
    assert f"error: {folder / 'ckpt_step2.pt'}: cannot be read" in captured.err
    assert sorted(summary["updates"]) == ["0", "1"]  # 1 -> 3 spans the failed checkpoint
    index = (out / "report" / "index.html").read_text()
    for figure in ("heatmaps.png", "sigma1.png", "spectra.png", "updates.png"):
        assert f"src='{figure}'" in index
        assert (out / "report" / figure).read_bytes()[:4] == b"\x89PNG"


def test_order_by_step_not_by_name_and_globs(tmp_path, capsys):
    state = _plain(zoo.nanogpt().model)
    for step in (10, 2, 100):
        torch.save(state, tmp_path / f"iter_{step}.pt")
    analysis = analyze_checkpoints([str(tmp_path / "iter_*.pt")], heads=4)
    assert analysis.steps == [2, 10, 100]
    assert analysis.updates[2]["L00"]["update_ratio_q"][0] == 0.0


def test_a_repeated_step_fails_the_second_checkpoint(tmp_path):
    state = _plain(zoo.nanogpt().model)
    torch.save(state, tmp_path / "step_4.pt")
    save_file(state, str(tmp_path / "step_4.safetensors"))
    analysis = analyze_checkpoints([tmp_path], heads=4)
    assert analysis.steps == [4]
    assert [p for p, _ in analysis.failures] == [str(tmp_path / "step_4.safetensors")]
    assert "step 4 again" in analysis.failures[0][1]


def test_tensorboard_steps_are_the_checkpoint_steps(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    state = _plain(zoo.nanogpt().model)
    for step in (5, 50):
        torch.save(state, tmp_path / f"step_{step}.pt")
    out = tmp_path / "out"
    assert main(["analyze", str(tmp_path / "step_5.pt"), str(tmp_path / "step_50.pt"), "--heads", "4",
                 "--out", str(out), "--no-report", "--quiet"]) == 0
    acc = EventAccumulator(str(out)).Reload()
    events = acc.Scalars("qk_sigma1/L01/H03")
    jsonl = _jsonl(out / "metrics.jsonl")
    assert [e.step for e in events] == [5, 50]
    assert events[0].value == pytest.approx(jsonl[(5, "qk_sigma1/L01/H03")], rel=1e-6)
    assert not (out / "report").exists()
    assert main(["analyze", str(tmp_path / "step_5.pt"), "--out", str(out), "--quiet"]) == 2  # out holds a run
    assert "--overwrite" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "step_5.pt"), "--heads", "4", "--out", str(out), "--quiet",
                 "--overwrite", "--no-report"]) == 0
    assert {s for s, _ in _jsonl(out / "metrics.jsonl")} == {5}
    assert math.isfinite(jsonl[(5, "update_ratio_q/L00")])


def test_canonical_order_undoes_sorted_safetensors_keys():
    from diag.layouts.statedict import canonical_key

    names = ["model.decoder.layers.0.encoder_attn", "model.decoder.layers.0.self_attn",
             "model.encoder.layers.10.self_attn", "model.encoder.layers.2.self_attn", "h.0.crossattention", "h.0.attn"]
    cross = {"model.decoder.layers.0.encoder_attn", "h.0.crossattention"}
    ordered = sorted(names, key=lambda n: canonical_key(n, n in cross))
    assert ordered == ["h.0.attn", "h.0.crossattention", "model.encoder.layers.2.self_attn",
                       "model.encoder.layers.10.self_attn", "model.decoder.layers.0.self_attn",
                       "model.decoder.layers.0.encoder_attn"]


def test_twelve_layers_from_safetensors_keep_their_numbers(tmp_path):
    """safetensors sorts keys as strings (h.10 before h.2): layer numbers must not follow that."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_head=2, n_embd=16, vocab_size=20, n_positions=8))
    save_file(_plain(model), tmp_path / "m.safetensors")
    _assert_same(_live_scalars(model), _offline_scalars([tmp_path / "m.safetensors"], heads=2))


def _output_projections(case) -> list[torch.Tensor]:
    """W_O (out, in) of every attention layer, by hand, in label order (BERT's beside the module, GPT-2's Conv1D)."""
    m = case.model
    if case.name.startswith("bert"):
        return [layer.attention.output.dense.weight for layer in m.bert.encoder.layer]
    if case.name.startswith("gpt2"):
        return [block.attn.c_proj.weight.T for block in m.transformer.h]
    if case.name.startswith("t5"):
        enc = [b.layer[0].SelfAttention.o.weight for b in m.encoder.block]
        return enc + [w for b in m.decoder.block for w in (b.layer[0].SelfAttention.o.weight,
                                                           b.layer[1].EncDecAttention.o.weight)]
    return [layer.attention.dense.weight for layer in m.gpt_neox.layers]


@pytest.mark.parametrize("name", ["gpt2-eager", "bert", "t5", "gpt-neox"])
def test_update_ratio_o_between_checkpoints_against_full_svd(name, tmp_path):
    """Two Hugging Face folders whose W_O alone differ: the offline update_ratio_o and update_fro_o of
    every layer are those of the full SVD of the difference; Q, K and V did not move (exactly 0)."""
    case = zoo.CASES[name]() if name in zoo.CASES else zoo.FAMILY_BUILDERS[name]()
    case.model.save_pretrained(tmp_path / "checkpoint-0")
    outputs = _output_projections(case)
    before = [w.detach().double().clone() for w in outputs]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i, w in enumerate(outputs):
            w += (1e-3 * (i + 1)) * torch.randn(w.shape, generator=gen)
    case.model.save_pretrained(tmp_path / "checkpoint-1")
    analysis = analyze_checkpoints([tmp_path / "checkpoint-0", tmp_path / "checkpoint-1"])
    assert not analysis.failures, analysis.failures
    updates = analysis.updates[0]
    assert len(updates) == len(outputs)
    for (label, metrics), w0, w in zip(updates.items(), before, outputs):
        dw = w.detach().double() - w0
        ratio = torch.linalg.svdvals(dw)[0] / torch.linalg.svdvals(w0)[0]
        assert metrics.pop("update_ratio_o")[0] == pytest.approx(ratio.item(), rel=1e-4), label
        assert metrics.pop("update_fro_o")[0] == pytest.approx((dw.norm() / w0.norm()).item(), rel=1e-4), label
        assert len(metrics) == 6 and all(v[0] == 0.0 for v in metrics.values()), (label, metrics)


def _scaled_series(folder, names: list[str], scales: list[float]) -> None:
    """nanoGPT state dicts whose Q/K/V weights are the first one's times ``scales``: sigma_1(dW)/sigma_1(W)
    between two of them is ``scales[i + 1] / scales[i] - 1`` exactly."""
    folder.mkdir()
    state = _plain(zoo.nanogpt().model)
    for name, scale in zip(names, scales):
        torch.save({k: v * scale if "c_attn" in k else v for k, v in state.items()}, folder / name)


def test_the_early_update_note_of_a_series_states_the_gap_and_its_bound(tmp_path):
    scales = [1.0, 21.0, 21.2, 21.4]  # an update 20 times the weights over the first 10 steps
    _scaled_series(tmp_path / "steps", [f"step_{s}.pt" for s in (0, 10, 20, 30)], scales)
    analysis = analyze_checkpoints([tmp_path / "steps"], heads=4)
    (note,) = [a for a in analysis.alerts if a.kind == "large_early_updates"]
    assert analysis.updates[0]["L00"]["update_ratio_q"][0] == pytest.approx(20.0, rel=1e-5)
    bound = (1 + 0.004) ** 10 - 1
    assert note.step == 0 and note.values["update_steps"] == 10 and note.values["bound"] == pytest.approx(bound)
    assert "from step 0 to step 10" in note.message and "over these 10 optimizer steps" in note.message
    assert f"{bound:.3g}" in note.message and "0.004)" not in note.message, note.message  # no per-step comparison
    _scaled_series(tmp_path / "positions", ["a.pt", "b.pt", "c.pt", "d.pt"], scales)  # no step anywhere
    (note,) = [a for a in analyze_checkpoints([tmp_path / "positions"], heads=4).alerts
               if a.kind == "large_early_updates"]
    assert "cannot be compared" in note.message and "update_steps" not in note.values, note.message
