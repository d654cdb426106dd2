"""The remedies for logit growth side by side: a learning-rate sweep of a LLaMA without QK-norm, four arms.

    OMP_NUM_THREADS=1 .venv/bin/python -m evaluation.remedies --seeds 0 1 2 --lrs 1e-3 3e-3 1e-2 3e-2 --steps 300 \\
        --out docs/figures/remedies.json

The model is Hugging Face's ``LlamaForCausalLM`` built from a config (nothing downloaded; ``sdpa`` attention,
rotary positions, no QK-norm): 2 layers, d_model 128, 4 query heads sharing 2 key/value heads (grouped-query
attention), head_dim 32, untied head, trained on the characters of Python's standard library source
(:func:`hooks.demo.load_text`, 101 characters) with a context of 256 and a batch of 8, AdamW (betas 0.9/0.95,
weight decay 0.1) at a constant learning rate, no warmup and no gradient clipping. For each seed and learning
rate, four arms start from the same weights and read the same batches in the same order:

* ``nothing``: AdamW alone;
* ``qkclip``: AdamW, then :class:`hooks.QKClip` (``--qk-tau``) after every step;
* ``steplimit``: AdamW wrapped in :class:`hooks.SpectralStepLimit` (``--sl-tau``);
* ``qknorm``: the QK-norm twin, Hugging Face's ``Qwen3ForCausalLM`` of the same shape (LLaMA with an RMSNorm on
  each head's q and k; at one seed it starts from the LLaMA's weights, its norm gains at 1), AdamW alone.

Each run records its every-step loss, its final loss (the mean of the last 50 steps), the largest pre-softmax
logit of any head on the observed steps (every ``--observe`` steps and the last one: a
:class:`hooks.steplimit.maxlogit.MaxLogits` armed for those forwards only, the same in every arm), the QK-clip
interventions, the CPU time of each step (``time.process_time``: forward, backward, optimizer step and remedy)
and a digest of its final weights. A run is *damaged* when its final loss exceeds its QK-norm twin's (same seed
and learning rate) by more than ``--margin`` nats (0.1). The cost of an arm is the median CPU time of its
unobserved steps over the nothing arm's, both measured in this process at the same seed and learning rate.

Writes the results (``--out``, JSON: the settings and every run), the table beside it (``.md``) and the figure
(``.png``: final loss and largest logit against the learning rate, per arm, each seed a point). Train one
process at a time, one thread: the CPU times are compared within the process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from torch.nn import functional as F

from hooks import QKClip, SpectralStepLimit
from hooks.demo import GPTConfig, adamw, encode, get_batch, load_text
from hooks.layout.discover import discover
from hooks.steplimit.maxlogit import MaxLogits

__all__ = ["ARMS", "Setup", "build", "figure", "main", "run_arm", "summarize", "sweep", "table"]

transformers.logging.set_verbosity_error()
ARMS = ("nothing", "qkclip", "steplimit", "qknorm")
LAST = 50  # the final loss is the mean of the last LAST steps' losses


@dataclass(frozen=True)
class Setup:
    """The model, the data and the remedies' settings every run of a sweep shares."""

    steps: int = 300
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # key/value heads, each shared by heads // kv_heads query heads
    width: int = 128
    context: int = 256
    batch: int = 8
    qk_tau: float = 25.0  # QKClip's bound on each head's largest logit
    sl_tau: float = 0.03  # SpectralStepLimit's bound on sigma_1(dW) / sigma_1(W)
    observe: int = 10  # the largest logit is read on every observe-th step and the last
    margin: float = 0.1  # nats above the QK-norm twin's final loss that make a run damaged
    chars: int = 2_000_000  # characters of the corpus


def build(arm: str, vocab: int, setup: Setup) -> torch.nn.Module:
    """The arm's model from its config: the LLaMA, or for ``qknorm`` Qwen3 of the same shape (built after
    ``torch.manual_seed`` both start from the same weights, Qwen3's q/k norm gains at 1)."""
    qknorm = arm == "qknorm"
    kind = transformers.Qwen3Config if qknorm else transformers.LlamaConfig
    cfg = kind(vocab_size=vocab, hidden_size=setup.width, intermediate_size=4 * setup.width,
               num_hidden_layers=setup.layers, num_attention_heads=setup.heads, num_key_value_heads=setup.kv_heads,
               head_dim=setup.width // setup.heads, max_position_embeddings=setup.context, tie_word_embeddings=False)
    model_class = transformers.Qwen3ForCausalLM if qknorm else transformers.LlamaForCausalLM
    return model_class._from_config(cfg, attn_implementation="sdpa")


def digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes, in order: equal digests are bit-identical weights."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_arm(arm: str, seed: int, lr: float, setup: Setup, data: torch.Tensor, vocab: int) -> dict:
    """Train one arm at one seed and learning rate; returns its record (losses, final loss, largest logit,
    interventions, CPU time per step, weight digest)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: expected one of {ARMS}")
    torch.manual_seed(seed)
    model = build(arm, vocab, setup)
    gen = torch.Generator().manual_seed(seed)  # the batches: the same order in every arm
    shape = GPTConfig(vocab_size=vocab, block_size=setup.context, batch_size=setup.batch)
    optimizer = adamw(model, lr)
    clip = QKClip(model, tau=setup.qk_tau) if arm == "qkclip" else None
    if arm == "steplimit":
        optimizer = SpectralStepLimit(optimizer, tau=setup.sl_tau, model=model)
    observer = MaxLogits(discover(model), model)
    losses: list[float] = []
    cpu: list[float] = []  # CPU seconds of each unobserved step
    logits: list[tuple[int, float]] = []  # (step, largest logit of any head) on the observed steps
    for step in range(setup.steps):
        observed = step % setup.observe == 0 or step == setup.steps - 1
        if observed:
            observer.arm()
        x, y = get_batch(data, shape, gen)
        start = time.process_time()
        model.train()
        out = model(input_ids=x).logits
        loss = F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        optimizer.step()
        if clip is not None:
            clip.step()
        optimizer.zero_grad(set_to_none=True)
        spent = time.process_time() - start
        losses.append(loss.item())
        if observed:
            maxima, _ = observer.take()
            observer.disarm()
            logits.append((step, max((float(m.max()) for m in maxima.values()), default=math.nan)))
        else:
            cpu.append(spent)
    tail = losses[-LAST:]
    return {"arm": arm, "seed": seed, "lr": lr, "losses": losses, "final_loss": sum(tail) / len(tail),
            "max_logit": max((v for _, v in logits), default=math.nan), "logits": logits,
            "interventions": clip.n_interventions if clip is not None else 0,
            "first_intervention": clip.interventions[0].step if clip is not None and clip.interventions else None,
            "cpu_median_s": statistics.median(cpu) if cpu else math.nan, "digest": digest(model)}


def sweep(seeds: list[int], lrs: list[float], arms: list[str], setup: Setup, log=print, save=None,
          done: list[dict] = ()) -> dict:
    """Every arm at every seed and learning rate, one after another in this process; the results file's dict
    (handed to ``save`` after every run too, so that a sweep cut short keeps the runs it finished). Runs in
    ``done`` (an earlier results file's, at the same setup) are kept and not trained again."""
    data, vocab = encode(load_text(setup.chars))
    runs: list[dict] = [r for r in done if r["arm"] in arms and r["seed"] in seeds and r["lr"] in lrs]
    results = {"setup": asdict(setup), "seeds": seeds, "lrs": lrs, "arms": arms, "vocab": vocab,
               "torch": torch.__version__, "transformers": transformers.__version__, "runs": runs}
    for lr in lrs:
        for seed in seeds:
            for arm in arms:
                if _find(runs, arm, seed, lr) is not None:
                    continue
                begun = time.time()
                r = run_arm(arm, seed, lr, setup, data, vocab)
                runs.append(r)
                log(f"lr {lr:g} seed {seed} {arm:<9} final {r['final_loss']:.3f}  max logit {r['max_logit']:7.2f}  "
                    f"clips {r['interventions']:4d}  {r['cpu_median_s'] * 1e3:6.1f} ms/step  "
                    f"({time.time() - begun:.0f} s)")
                if save is not None:
                    save(results)
    return results


def _find(runs: list[dict], arm: str, seed: int, lr: float) -> dict | None:
    return next((r for r in runs if r["arm"] == arm and r["seed"] == seed and r["lr"] == lr), None)


def summarize(results: dict) -> list[dict]:
    """One row per arm and learning rate, over the seeds: final loss (mean, min, max), its excess over the QK-norm
    twin's, damaged seeds, largest logit, QK-clip interventions, cost over the nothing arm, and for QK-clip
    runs without an intervention whether they are bit-identical to the nothing arm."""
    runs, margin = results["runs"], results["setup"]["margin"]
    rows = []
    for lr in results["lrs"]:
        for arm in results["arms"]:
            mine = [r for r in runs if r["arm"] == arm and r["lr"] == lr]
            if not mine:
                continue
            twins = [_find(runs, "qknorm", r["seed"], lr) for r in mine]
            plain = [_find(runs, "nothing", r["seed"], lr) for r in mine]
            excess = [r["final_loss"] - t["final_loss"] if t else math.nan for r, t in zip(mine, twins, strict=True)]
            # a NaN final loss (a diverged run) counts as damaged; a missing twin leaves the verdict open
            damaged = sum(not (e <= margin) for e in excess) if all(twins) else None
            cost = [r["cpu_median_s"] / p["cpu_median_s"] for r, p in zip(mine, plain, strict=True) if p]
            quiet = [(r, p) for r, p in zip(mine, plain, strict=True) if arm == "qkclip" and p and
                     r["interventions"] == 0]
            finals = [r["final_loss"] for r in mine]
            rows.append({
                "arm": arm, "lr": lr, "seeds": [r["seed"] for r in mine], "final_loss": finals,
                "final_mean": sum(finals) / len(finals), "final_min": min(finals), "final_max": max(finals),
                "excess": excess, "damaged": damaged,
                "max_logit": max(r["max_logit"] for r in mine),
                "interventions": [r["interventions"] for r in mine],
                "cost": sum(cost) / len(cost) if cost else None,
                "bit_identical": [r["losses"] == p["losses"] and r["digest"] == p["digest"] for r, p in quiet],
            })
    return rows


def table(rows: list[dict], setup: dict) -> str:
    """The rows as a markdown table."""
    lines = ["| lr | arm | final loss (mean, min-max) | over the twin (per seed) | damaged | largest logit | "
             "QK-clip interventions | CPU per step vs nothing | no-clip runs bit-identical to nothing |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = len(r["seeds"])
        excess = " ".join("-" if math.isnan(e) else f"{e:+.3f}" for e in r["excess"])
        damaged = "-" if r["damaged"] is None else f"{r['damaged']}/{n}"
        clips = " ".join(str(i) for i in r["interventions"]) if r["arm"] == "qkclip" else "-"
        cost = "-" if r["cost"] is None else f"x{r['cost']:.2f}"
        same = (f"{sum(r['bit_identical'])}/{len(r['bit_identical'])}" if r["bit_identical"] else "-")
        lines.append(f"| {r['lr']:g} | {r['arm']} | {r['final_mean']:.3f} ({r['final_min']:.3f}-{r['final_max']:.3f})"
                     f" | {excess} | {damaged} | {r['max_logit']:.1f} | {clips} | {cost} | {same} |")
    return "\n".join(lines) + (f"\n\nDamaged: final loss (mean of the last {LAST} steps) more than {setup['margin']:g} "
                               "nats above the QK-norm twin's at the same seed and learning rate. QK-clip tau "
                               f"{setup['qk_tau']:g}, step-limit tau {setup['sl_tau']:g}; {setup['steps']} steps.\n")


def figure(results: dict, rows: list[dict], path: Path) -> None:
    """Final loss and largest logit against the learning rate, per arm: the seeds' mean joined, each seed a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colours = {"nothing": "tab:red", "qkclip": "tab:blue", "steplimit": "tab:green", "qknorm": "tab:gray"}
    for arm in results["arms"]:
        mine = [r for r in rows if r["arm"] == arm]
        lrs = [r["lr"] for r in mine]
        axes[0].plot(lrs, [r["final_mean"] for r in mine], "-", color=colours[arm], label=arm)
        for r in mine:
            axes[0].plot([r["lr"]] * len(r["final_loss"]), r["final_loss"], "o", color=colours[arm], ms=4, alpha=0.7)
        runs = [r for r in results["runs"] if r["arm"] == arm]
        axes[1].plot([r["lr"] for r in runs], [r["max_logit"] for r in runs], "o", color=colours[arm], ms=4,
                     alpha=0.7, label=arm)
    if "qkclip" in results["arms"]:
        axes[1].axhline(results["setup"]["qk_tau"], color="tab:blue", ls=":", lw=1, label="QK-clip tau")
    axes[0].set(xscale="log", xlabel="learning rate", ylabel=f"final loss (mean of last {LAST} steps)",
                title="final loss per arm (line: mean; points: seeds)")
    axes[1].set(xscale="log", yscale="log", xlabel="learning rate", ylabel="largest attention logit (observed steps)",
                title="largest logit reached")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=Setup.steps)
    parser.add_argument("--qk-tau", type=float, default=Setup.qk_tau)
    parser.add_argument("--sl-tau", type=float, default=Setup.sl_tau)
    parser.add_argument("--layers", type=int, default=Setup.layers)
    parser.add_argument("--heads", type=int, default=Setup.heads)
    parser.add_argument("--kv-heads", type=int, default=Setup.kv_heads)
    parser.add_argument("--width", type=int, default=Setup.width)
    parser.add_argument("--context", type=int, default=Setup.context)
    parser.add_argument("--batch", type=int, default=Setup.batch)
    parser.add_argument("--observe", type=int, default=Setup.observe)
    parser.add_argument("--margin", type=float, default=Setup.margin)
    parser.add_argument("--chars", type=int, default=Setup.chars)
    parser.add_argument("--out", type=Path, default=None,
                        help="the results file (.json); the table and the figure are written beside it (.md, .png)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --out (same settings) and train only the missing ones")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = Setup(steps=args.steps, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, width=args.width,
                  context=args.context, batch=args.batch, qk_tau=args.qk_tau, sl_tau=args.sl_tau,
                  observe=args.observe, margin=args.margin, chars=args.chars)
    save, done = None, []
    if args.resume and args.out is not None and args.out.exists():
        earlier = json.loads(args.out.read_text())
        if earlier["setup"] != asdict(setup):
            parser.error(f"--resume: {args.out} was written with other settings ({earlier['setup']})")
        done = earlier["runs"]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def save(results: dict) -> None:
            args.out.write_text(json.dumps(results, indent=1) + "\n")

    results = sweep(args.seeds, args.lrs, args.arms, setup, log=lambda line: print(line, flush=True), save=save,
                    done=done)
    rows = summarize(results)
    text = table(rows, results["setup"])
    print(text)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(text)
        figure(results, rows, args.out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
