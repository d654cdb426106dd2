"""Memory and time of ``analyze`` on Llama-shaped checkpoints of real size: a series of two checkpoints.

    .venv/bin/python benchmarks/analyze_scale.py                      # small: 8B width, 4 layers (~1 min)
    .venv/bin/python benchmarks/analyze_scale.py --shape 8b           # Llama-3-8B shape, 2 x 16 GB on disk
    .venv/bin/python benchmarks/analyze_scale.py --shape 70b          # 70B width, 2 layers, 2 x 7.6 GB
    .venv/bin/python benchmarks/analyze_scale.py --shape 70b --layers 4 --baseline /path/to/old/checkout

Writes two Hugging Face folders (``step-1000/``, ``step-2000/``: ``config.json``, sharded
``model-*.safetensors`` and ``model.safetensors.index.json``, as ``save_pretrained`` writes them) of random
bf16 weights; the second differs from the first by a small update of every attention weight (its other
shards are hard links to the first's: the analysis reads only Q/K/V/O). Then runs the analysis of the
two-checkpoint series in a fresh process, with no options (the layouts found by the probe forward on the
model built from ``config.json``), and prints its peak resident memory (``ru_maxrss``), after the plan (the
layout probe) and overall, the time per layer (spectra of both checkpoints and the update between them), and
the memory against one layer's attention weights. ``--baseline DIR`` runs the same in a checkout of another
version, side by side. The folders are deleted at the end (``--keep`` keeps them).

The claim it checks: peak memory is about two layers' attention weights plus a constant, whatever the depth
(compare ``--layers``), the feed-forward width or the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # width, query heads, key/value heads, feed-forward width, vocabulary, layers
    "small": (4096, 32, 8, 14336, 128256, 4),
    "8b": (4096, 32, 8, 14336, 128256, 32),
    "70b": (8192, 64, 8, 28672, 128256, 2),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _config(width: int, heads: int, kv: int, ffn: int, vocab: int, layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": width,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _random(shape: tuple[int, ...], gen):
    import torch

    return (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)


def _attention(cfg: dict, i: int, gen) -> dict:
    e, h, g = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = e // h
    rows = {"q_proj": h * d, "k_proj": g * d, "v_proj": g * d, "o_proj": e}
    cols = {"q_proj": e, "k_proj": e, "v_proj": e, "o_proj": h * d}
    return {f"model.layers.{i}.self_attn.{n}.weight": _random((rows[n], cols[n]), gen) for n in ATTENTION}


def _rest(cfg: dict, i: int, gen) -> dict:
    import torch

    e, f = cfg["hidden_size"], cfg["intermediate_size"]
    out = {f"model.layers.{i}.mlp.{n}.weight": _random(s, gen)
           for n, s in (("gate_proj", (f, e)), ("up_proj", (f, e)), ("down_proj", (e, f)))}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{i}.{norm}.weight"] = torch.ones(e, dtype=torch.bfloat16)
    return out


def write_folder(folder: Path, cfg: dict, seed: int, base: Path | None = None) -> None:
    """A sharded folder; with ``base``, the attention of ``base`` plus a small update, the rest hard-linked."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    layers = cfg["num_hidden_layers"]
    names = ["embed"] + [f"{kind}-{i}" for i in range(layers) for kind in ("attn", "rest")] + ["head"]
    shard = {n: f"model-{j + 1:05d}-of-{len(names):05d}.safetensors" for j, n in enumerate(names)}
    weight_map, total = {}, 0
    for name in names:
        path = folder / shard[name]
        if base is not None and not name.startswith("attn"):
            os.link(base / shard[name], path)
            with safe_open(str(path), framework="pt") as f:  # names and sizes from the header
                for key in f.keys():  # noqa: SIM118 - safe_open is no dict
                    weight_map[key] = shard[name]
                    total += 2 * int(torch.tensor(f.get_slice(key).get_shape()).prod())
            continue
        if name.startswith("attn"):
            i = int(name.split("-")[1])
            tensors = _attention(cfg, i, gen)
            if base is not None:
                before = load_file(str(base / shard[name]))
                tensors = {k: (before[k].float() + 1e-3 * v.float()).to(torch.bfloat16) for k, v in tensors.items()}
            save_file(tensors, str(path), metadata={"format": "pt"})
        else:
            e, v = cfg["hidden_size"], cfg["vocab_size"]
            if name == "embed":
                tensors = {"model.embed_tokens.weight": _random((v, e), gen)}
            elif name == "head":
                tensors = {"model.norm.weight": torch.ones(e, dtype=torch.bfloat16),
                           "lm_head.weight": _random((v, e), gen)}
            else:
                tensors = _rest(cfg, int(name.split("-")[1]), gen)
            save_file(tensors, str(path), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = shard[name]
            total += t.numel() * t.element_size()
        del tensors
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}, indent=1))


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _given_layout(paths: list[str]) -> dict:
    """The layouts as a spec (no probe forward): the series alone is measured."""
    from diag.layouts.vocab import QKVLayout

    cfg = json.loads((Path(paths[0]) / "config.json").read_text())
    h, g = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layout = QKVLayout(h, cfg["hidden_size"] // h, "q_proj.weight", "k_proj.weight", "v_proj.weight", n_kv_heads=g,
                       o="o_proj.weight")
    return {"model.layers.*.self_attn": layout}


def child(paths: list[str], out: str, jobs: int, given: bool) -> None:
    """The measured process: the analysis as ``analyze`` runs it with no options (``given``: with the layouts
    given, no probe forward); prints one JSON line."""
    start = time.perf_counter()
    marks: list[tuple[float, float]] = []

    def progress(items):
        marks.append((time.perf_counter(), _maxrss_mb()))  # the plan (steps, layouts: the probe forward) is done
        yield from items
        marks.append((time.perf_counter(), _maxrss_mb()))

    from diag.offline.series import analyze_checkpoints
    from diag.outputs.sinks import JsonlSink

    try:
        from hooks.checkpoint.search import ModelLayouts
    except ImportError:  # an older checkout
        from hooks.hf_layout import ModelLayouts  # type: ignore[no-redef]
    imported = (time.perf_counter(), _maxrss_mb())
    sink = JsonlSink(Path(out) / "metrics.jsonl")
    kwargs = {"jobs": jobs} if jobs > 1 else {}
    kwargs.update({"layout": _given_layout(paths)} if given else {"model_layout": ModelLayouts()})
    analysis = analyze_checkpoints(paths, sinks=[sink], progress=progress, **kwargs)
    sink.close()
    end = time.perf_counter()
    print(json.dumps({"failures": analysis.failures, "steps": analysis.steps, "layers": len(analysis.layers),
                      "imports_s": imported[0] - start, "imports_mb": imported[1],
                      "plan_s": marks[0][0] - imported[0], "plan_mb": marks[0][1],
                      "series_s": marks[-1][0] - marks[0][0], "total_s": end - start, "peak_mb": _maxrss_mb()}))


def _run(args: list[str], env: dict, cwd: Path) -> str:
    """A fresh process of this script. This process never imports torch nor holds tensors: Linux carries a
    process's peak resident memory across ``exec``, so a child forked from a large parent would report the
    parent's."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], env=env, capture_output=True,
                          text=True, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{args[0]} failed in {cwd}:\n{done.stderr[-3000:]}")
    return done.stdout


def measure(paths: list[Path], checkout: Path, jobs: int, threads: int, given: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as out:
        stdout = _run(["--child", out, "--jobs", str(jobs), *(["--given"] if given else []), *map(str, paths)], env,
                      checkout)
    return json.loads(stdout.strip().splitlines()[-1])


def _report(cfg: dict, results: dict[str, dict]) -> None:
    e, h, g = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layer_mb = (2 * e * e + 2 * e * (e // h) * g) * 2 / 2**20  # one layer's Q/K/V/O in bf16
    layers = cfg["num_hidden_layers"]
    print(f"shape: width {e}, heads {h}/{g}, ffn {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, {layers} "
          f"layers; one layer's attention weights {layer_mb:.0f} MB (bf16), two layers {2 * layer_mb:.0f} MB")
    print(f"{'':>10} {'imports MB':>10} {'plan MB':>8} {'peak MB':>8} {'peak - imports':>15} {'/ 2 layers':>10} "
          f"{'plan s':>7} {'series s':>9} {'s / layer':>9}")
    for name, r in results.items():
        above = r["peak_mb"] - r["imports_mb"]
        print(f"{name:>10} {r['imports_mb']:10.0f} {r['plan_mb']:8.0f} {r['peak_mb']:8.0f} {above:15.0f} "
              f"{above / (2 * layer_mb):10.2f} {r['plan_s']:7.1f} {r['series_s']:9.1f} "
              f"{r['series_s'] / layers:9.2f}")
    print("this: no options (the layouts found by the probe forward: 'plan'); given: the layouts given as a spec, "
          "no probe (the series alone)")
    if "baseline" in results:
        ra, rb = results["baseline"], results["this"]
        print(f"peak ratio this / baseline: {rb['peak_mb'] / ra['peak_mb']:.2f}; time ratio: "
              f"{rb['total_s'] / ra['total_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--layers", type=int, help="layers (default: the shape's)")
    parser.add_argument("--dir", type=Path, help="where to write the folders (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the folders")
    parser.add_argument("--folders", type=Path, nargs=2, metavar=("FIRST", "SECOND"),
                        help="measure two folders written before (with --keep) instead of writing new ones")
    parser.add_argument("--baseline", type=Path, help="a checkout of another version to run side by side")
    parser.add_argument("--jobs", type=int, default=1, help="--jobs of the analysis (default: 1)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the analysis (default: 1)")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--given", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.paths, args.child, args.jobs, args.given)
    if args.write:
        first, second = map(Path, args.paths)
        write_folder(first, json.loads(args.write), seed=0)
        return write_folder(second, json.loads(args.write), seed=1, base=first)
    width, heads, kv, ffn, vocab, layers = SHAPES[args.shape]
    cfg = _config(width, heads, kv, ffn, vocab, args.layers or layers)
    if args.folders:
        first, second = args.folders
        cfg = json.loads((first / "config.json").read_text())
    root = None if args.folders else Path(tempfile.mkdtemp(prefix="analyze_scale-", dir=args.dir))
    try:
        if root is not None:
            start = time.perf_counter()
            first, second = root / "step-1000", root / "step-2000"
            _run(["--write", json.dumps(cfg), str(first), str(second)], dict(os.environ), Path.cwd())
            print(f"wrote {first} and {second} in {time.perf_counter() - start:.0f} s")
        size = sum(f.stat().st_size for f in first.iterdir()) / 2**30
        print(f"{first}, {second}: {size:.1f} GB each on disk (the second's non-attention shards hard links)")
        results = {}
        if args.baseline is not None:
            results["baseline"] = measure([first, second], args.baseline.resolve(), 1, args.threads)
        here = Path(__file__).resolve().parents[1]
        results["this"] = measure([first, second], here, args.jobs, args.threads)
        results["given"] = measure([first, second], here, args.jobs, args.threads, given=True)
        _report(cfg, results)
    finally:
        if root is not None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
