"""What watching costs: ratios measured side by side in one run (not a timed test).

    .venv/bin/python benchmarks/overhead.py --models 4x256 small --only 2 3 4 5 --reps 1   # the cost table
    .venv/bin/python benchmarks/overhead.py --models 4x256 --only 2 --paired --reps 5 --everys default  # paired steps
    .venv/bin/python benchmarks/overhead.py --models small --reps 5
    .venv/bin/python benchmarks/overhead.py --models medium --only 1 --reps 1   # 24 layers x 1024
    .venv/bin/python benchmarks/overhead.py --only 6 --reps 3 --threads 1   # attention at 128 .. 8,192 tokens
    python benchmarks/overhead.py --device cuda --models small medium --only 1 2 3 --reps 3   # on a GPU
    python benchmarks/overhead.py --device cuda --models small --only 2 4 --min-step-ms 100   # a batch of >= 100 ms

Prints, for each GPT-2-shaped model given (Hugging Face, sdpa attention, random
init, batch 4 x 128 tokens: ``--batch``; ``--min-step-ms`` doubles the batch until a plain
training step takes that long), one after the other in the same run, with the
machine's load (``uptime``) beside each item. Times are this process's CPU time
(``--clock cpu``, the default: another process's load adds waits to wall time, not
to it; run with ``--threads 1`` so it counts one core's work) or wall time:
  1. exact spectra of all heads (d_head x d_head core) vs the naive full SVD of each
     d_model x d_model product: time ratio and the largest relative disagreement;
  2. training-step time with the Monitor (writing to a logdir in a temporary folder, as the README's first
     example: TensorBoard events, metrics.jsonl, alerts.jsonl, images, layout; ``--sink-only``: a MemorySink
     and no logdir) at its default cadence (``every`` unset:
     loss and gradient norms every 10 steps, the spectra every 20, attention every 50,
     update ratios every 100) and at every=1, 10, 100 vs no Monitor, over whole sampling periods (100 steps
     for the default and every=100), each window run back to back with the same steps
     unmonitored: median (min, max) time ratios (incl. the final close()), and the
     Monitor's accounted share of the window (time inside monitor.step plus the time
     the attention capture spends inside the forward: its own parts, so far less noisy
     than the ratio of two windows on a shared machine);
  3. the cost of one non-sampled ``monitor.step`` call, relative to a training step;
  4. the cost of each signal family on a sampled step, as a fraction of one step
     (update ratios of W_Q, W_K, W_V, W_O: around a real AdamW step, cold at the
     first sample, then warm);
  5. peak resident memory of a training run with the Monitor (every=1, all signals)
     and without, each in its own child process, alternated;
  6. attention capture cost as the sequence grows (128 .. 8,192 tokens, batch 1, a
     2-layer GPT-2 of d_model 256 and 8 heads by default): the capture's time per
     sampled layer against the same model's forward and backward without it, with the
     default long-context reading (entropy from ``attn_entropy_rows`` spread rows, max
     logit in float32) and with every row in float64.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import torch

from diag.layouts.vocab import split_qkv
from diag.math.spectral import qk_singular_values, qk_singular_values_reference
from diag.outputs.sinks import MemorySink
from hooks.layout.discover import discover
from hooks.monitor.monitor import SIGNALS, Monitor

# layers, heads, d_model; "4x256" is a small GPT-2 (4 layers x 8 heads, d_model 256; docs/cost.md)
SHAPES = {"small": (12, 12, 768), "4x256": (4, 8, 256), "medium": (24, 16, 1024), "tiny": (2, 4, 64)}


def clock() -> float:
    """Seconds on the clock chosen with --clock: this process's CPU time (default; immune to the waits
    another process's load adds; docs/cost.md reports CPU time) or wall time. On a CUDA device
    (``--device cuda``) wall time after the device finished its queued work (a synchronisation at every
    reading, in the watched and the plain steps alike: the kernels' own time, not the host's)."""
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time() if CLOCK == "cpu" else time.perf_counter()


CLOCK = "cpu"
DEVICE = "cpu"
DATA = "fixed"
BATCH = (4, 128)  # sequences x tokens of a training batch (--batch, --min-step-ms)
LR = 1e-4  # AdamW's learning rate (--lr)
SINK_ONLY = False  # item 2 with a MemorySink and no logdir (--sink-only)


class Watched:
    """Item 2's Monitor as the README's first example builds it: a ``logdir`` (TensorBoard events and sub-runs,
    ``metrics.jsonl``, ``alerts.jsonl``, the images and the custom-scalars layout: whatever the defaults write) in a
    fresh temporary folder, removed at :meth:`close`; with ``--sink-only`` no logdir. A ``MemorySink`` rides along
    in both (the blocks count the sampled steps from it: a list append per record)."""

    def __init__(self, model, every: int | None) -> None:
        import tempfile

        self.sink = MemorySink()
        self.folder = None if SINK_ONLY else tempfile.mkdtemp(prefix="attnscope-overhead-")
        self.monitor = Monitor(model, every=every, sinks=[self.sink], logdir=self.folder)

    def close(self) -> float:
        """Closes the Monitor (timed: its seconds are returned) and removes the folder."""
        import shutil

        t0 = clock()
        self.monitor.close()
        took = clock() - t0
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        return took


def outputs() -> str:
    """What item 2's Monitor writes to, for its heading."""
    return "a MemorySink, no logdir (--sink-only)" if SINK_ONLY else "a logdir, as the README's first example"


class Batches:
    """The training batches, ``BATCH`` (4 x 128 tokens unless --batch), the same sequence of them for every model
    trained (``--data``):

    * ``fixed``: one batch of random tokens, trained on at every step;
    * ``text``: windows of the Python standard library's source (characters), a new batch every step, each
      sequence's labels its own next characters: the model learns;
    * ``stuck``: the same text windows with the labels of other, independent windows: nothing beyond the
      characters' frequencies can be learned, so the loss stops falling within a few dozen steps and stays
      (a plateau).
    """

    def __init__(self, data: str = "fixed", seed: int = 0) -> None:
        self.data, self.gen = data, torch.Generator().manual_seed(seed)
        if data == "fixed":
            self.fixed = torch.randint(0, 8192, BATCH, generator=self.gen).to(DEVICE)
        else:
            from hooks.demo.data import encode, load_text

            self.text, _ = encode(load_text(1_000_000))

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) of the next step (labels as Hugging Face takes them: shifted inside)."""
        if self.data == "fixed":
            return self.fixed, self.fixed
        (rows, tokens), doubled = BATCH, self.data == "stuck"
        starts = torch.randint(len(self.text) - tokens - 1, (2 * rows if doubled else rows,), generator=self.gen)
        windows = torch.stack([self.text[i : i + tokens] for i in starts.tolist()]).to(DEVICE)
        return windows[:rows], windows[rows:] if doubled else windows[:rows]


def load() -> str:
    """The machine's load averages (1, 5, 15 min) and CPUs: printed beside every figure."""
    import os

    one, five, fifteen = os.getloadavg()
    return f"[load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs]"


def build(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, heads, width = SHAPES[size]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=8192, n_positions=max(256, BATCH[1]))
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").to(DEVICE)


def spectra(model, reps: int) -> None:
    layers = discover(model)
    qs, ks = zip(*(split_qkv({n: p.detach() for n, p in a.params().items()}, a.layout)[:2] for a in layers))
    wq, wk = torch.cat(qs), torch.cat(ks)
    fast, slow = [], []
    for _ in range(reps):
        t0 = clock()
        sv = qk_singular_values(wq, wk)
        t1 = clock()
        ref = torch.stack([qk_singular_values_reference(wq[h], wk[h]) for h in range(wq.shape[0])])
        t2 = clock()
        fast.append(t1 - t0)
        slow.append(t2 - t1)
    err = ((sv - ref).abs() / ref[:, :1]).max().item()
    ratio = [s / f for s, f in zip(slow, fast)]
    print(f"1. spectra of {wq.shape[0]} heads: core {statistics.median(fast) * 1e3:.1f} ms, naive SVD "
          f"{statistics.median(slow) * 1e3:.0f} ms; naive/core {statistics.median(ratio):.1f}x "
          f"(min {min(ratio):.1f}, max {max(ratio):.1f}); max |diff|/sigma_1 {err:.1e}")


def timed_capture(monitor) -> list[float]:
    """Accumulates, in the returned one-element list, the seconds the Monitor's attention capture spends
    reducing attention calls to statistics inside the forward (its ``_record``)."""
    spent = [0.0]
    record = monitor.capture._record

    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return record(*args, **kwargs)
        finally:
            spent[0] += clock() - t0

    monitor.capture._record = timed
    return spent


def train_steps(model, monitor, steps: int, start: int, parts: list | None = None) -> list[float]:
    """Step times; with ``parts``, also appends (forward+backward seconds, monitor.step seconds, capture
    seconds inside that forward) per step."""
    captured = timed_capture(monitor) if monitor is not None else [0.0]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = Batches(DATA)
    times = []
    for step in range(start, start + steps):
        ids, labels = batches()
        t0 = clock()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        t1 = clock()
        if monitor is not None:
            monitor.step(step, loss=loss)
        t2 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(clock() - t0)
        if parts is not None:
            parts.append((t1 - t0, t2 - t1, captured[0]))
            captured[0] = 0.0
    return times


def train_paired(plain_model, model, monitor, steps: int, per_step: list | None = None) -> tuple[float, float, list]:
    """The same ``steps`` on two copies of the model, one step of each in turn: ``plain_model`` unwatched,
    ``model`` with ``monitor``, the plain copy first on even steps and the watched one first on odd steps (the
    second step of a pair finds the batch in the caches). Returns (plain seconds, watched seconds, watched parts as in
    train_steps); with ``per_step``, also appends (plain seconds, watched seconds) of every step.
    Pairing each watched step with a plain step taken right before it cancels the machine's drifts (another
    process's load, frequency changes) that make two back-to-back windows differ by a percent or more."""
    captured = timed_capture(monitor)
    batches = Batches(DATA)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (plain_model, model)]
    plain = watched = 0.0
    parts = []
    took = [0.0, 0.0]  # this step's seconds: plain, watched
    for step in range(steps):
        ids, labels = batches()
        order = ((0, plain_model, opts[0]), (1, model, opts[1]))
        for which, m, opt in order if step % 2 == 0 else order[::-1]:  # each copy first every other step
            t0 = clock()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            t1 = clock()
            if which:
                monitor.step(step, loss=loss)
            t2 = clock()
            opt.step()
            opt.zero_grad(set_to_none=True)
            took[which] = clock() - t0
            if which:
                parts.append((t1 - t0, t2 - t1, captured[0]))
                captured[0] = 0.0
        plain, watched = plain + took[0], watched + took[1]
        if per_step is not None:
            per_step.append((took[0], took[1]))
    return plain, watched, parts


def paired_overhead(model, reps: int, steps: int, everys=("default",)) -> float:
    """Item 2 with paired steps (``--paired``): each repetition trains a fresh copy of the model with the
    Monitor and another without it, one step of each in turn, over whole sampling periods (as item 2)."""
    import copy

    print(f"2. paired steps, the Monitor's copy / the plain copy (one step of each in turn), the Monitor writing to "
          f"{outputs()}: {load()}")
    steps_plain: list[float] = []
    for name in everys:
        every, n = window(model, name, steps)
        ratios, shares = [], []
        for _ in range(reps):
            plain_model, watched_model = copy.deepcopy(model), copy.deepcopy(model)
            for m in (plain_model, watched_model):  # a first step of each copy, untimed (allocator, caches)
                train_steps(m, None, 1, 0)
            watch = Watched(watched_model, every)
            plain, watched, parts = train_paired(plain_model, watched_model, watch.monitor, n)
            close = watch.close()
            ratios.append((watched + close) / plain)
            shares.append(accounted(parts, close, plain / n))
            steps_plain.append(plain / n)
            del plain_model, watched_model, watch
        report(every, n, ratios, shares)
    base = statistics.median(steps_plain)
    print(f"   training step without monitor: {base * 1e3:.0f} ms (median)")
    return base


def paired_blocks(model, blocks: int, steps: int, everys=("default",)) -> float:
    """Item 2 as one long run (``--paired --blocks N``): a watched and a plain copy of the model trained side by side,
    one step of each in turn, for N whole sampling periods; the time ratio of each period (block), so the first
    block holds the run's cold first samples and its early look, and the others the steady state."""
    import copy

    print(f"2. one run of paired steps in blocks of one sampling period, the Monitor's copy / the plain copy, the "
          f"Monitor writing to {outputs()}; lr {LR:g}, data {DATA}: {load()}")
    steps_plain: list[float] = []
    for name in everys:
        every, n = window(model, name, steps)
        plain_model, watched_model = copy.deepcopy(model), copy.deepcopy(model)
        for m in (plain_model, watched_model):  # a first step of each copy, untimed (allocator, caches)
            train_steps(m, None, 1, 0)
        watch = Watched(watched_model, every)
        sink, monitor = watch.sink, watch.monitor
        per_step: list[tuple[float, float]] = []
        _, _, parts = train_paired(plain_model, watched_model, monitor, n * blocks, per_step)
        close = watch.close()
        ratios, shares = [], []
        for b in range(blocks):
            block = per_step[b * n : (b + 1) * n]
            plain = sum(p for p, _ in block)
            extra = close if b == blocks - 1 else 0.0  # the final close() counts in the last block
            ratios.append((sum(w for _, w in block) + extra) / plain)
            shares.append(accounted(parts[b * n : (b + 1) * n], extra, plain / n))
            steps_plain.append(plain / n)
        report(every, n, ratios, shares)
        steady = ratios[1:]
        print(f"   the blocks after the first (steady state): median {statistics.median(steady):.4f} "
              f"(min {min(steady):.4f}, max {max(steady):.4f}); the first block {ratios[0]:.4f}")
        sampled = {family: len({r.step for r in sink.records if any(t.startswith(tag) for t in r.scalars)})
                   for family, tag in (("attention", "attn_entropy/"), ("spectra", "qk_sigma1/"),
                                       ("updates", "update_ratio_q/"), ("grads", "grad_norm_q/"))}
        print(f"   steps sampled of {n * blocks}: {sampled} (the closer look adds attention samples while it is asked)")
        alerts = [(a.step, a.kind) for a in monitor.alert_sink.history]
        print(f"   alerts in the watched run: {alerts[:8]}{' ...' if len(alerts) > 8 else ''}")
    base = statistics.median(steps_plain)
    print(f"   training step without monitor: {base * 1e3:.0f} ms (median)")
    return base


def window(model, name: str, steps: int) -> tuple[int | None, int]:
    """(every, window length): ``name`` is "default" or an integer; the window covers whole sampling periods,
    steps 0 .. max(P, steps)-1 rounded up to a multiple of P, the steps that sample every family."""
    every = None if name == "default" else int(name)
    probe = Monitor(model, every=every, sinks=[MemorySink()])
    period = probe.cadence.full
    probe.close()
    return every, -(-max(period, steps) // period) * period


def report(every: int | None, n: int, ratios: list[float], shares: list[float]) -> None:
    label = "default" if every is None else f"every={every}"
    print(f"   {label:<9} ({n:3d} steps): time ratio {statistics.median(ratios):.4f} "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f}; each: {', '.join(f'{r:.4f}' for r in ratios)}); "
          f"accounted share of the Monitor {statistics.median(shares) * 100:.2f}% (min {min(shares) * 100:.2f}, "
          f"max {max(shares) * 100:.2f}) {load()}")


def accounted(watched_parts: list, close: float, base: float) -> float:
    """The Monitor's share of a window from its own parts, far less noisy than a ratio of two windows:
    the time inside monitor.step (incl. close) plus the time the attention capture spends inside
    the forward (the TorchFunctionMode's own dispatch overhead is not in it), as a fraction of the
    window's plain time."""
    extra = close + sum(m + c for _, m, c in watched_parts)
    return extra / (base * len(watched_parts))


def overhead(model, reps: int, steps: int, everys=("default", "1", "10", "100")) -> float:
    """Each window covers whole sampling periods: steps 0 .. max(P, steps)-1 rounded up to a multiple
    of P, the steps that sample every family (P = N for every=N, 100 for the default cadence), so each
    family is sampled exactly its share of steps, against the same steps without the Monitor, the two
    run back to back in every repetition."""
    train_steps(model, None, 2, 0)  # warm up
    base_times: list[float] = []
    print(f"2. training-step time with the Monitor / without (same steps, back to back), the Monitor writing to "
          f"{outputs()}: {load()}")
    for name in everys:
        every, n = window(model, name, steps)
        ratios, shares = [], []
        for _ in range(reps):
            plain_parts: list = []
            plain = sum(train_steps(model, None, n, 0, plain_parts))
            watch = Watched(model, every)
            watched_parts: list = []
            watched = sum(train_steps(model, watch.monitor, n, 0, watched_parts))
            close = watch.close()  # measures the last sampled step's pending update ratios, writes what waits
            ratios.append((watched + close) / plain)
            shares.append(accounted(watched_parts, close, plain / n))
            base_times.append(plain / n)
        report(every, n, ratios, shares)
    base = statistics.median(base_times)
    print(f"   training step without monitor: {base * 1e3:.0f} ms (median)")
    return base


def calibrate(model, min_ms: float, most: int) -> str:
    """Doubles the batch's sequences (``BATCH``, from --batch) until a plain training step takes at least
    ``min_ms`` (the median of 3 after one untimed step) or the batch holds ``most`` sequences; on a device that
    runs out of memory, the last batch that fitted. Returns what it found, for the model's line."""
    global BATCH
    rows, tokens = BATCH
    fitted = None
    while True:
        BATCH = (rows, tokens)
        try:
            train_steps(model, None, 1, 0)
            step = statistics.median(train_steps(model, None, 3, 0))
        except torch.OutOfMemoryError:
            if fitted is None:
                raise
            torch.cuda.empty_cache()
            BATCH = fitted[0]
            return f"the largest that fits: {fitted[1] * 1e3:.0f} ms, short of {min_ms:g} ms"
        fitted = (BATCH, step)
        if step * 1e3 >= min_ms or 2 * rows > most:
            short = "" if step * 1e3 >= min_ms else f", short of {min_ms:g} ms at the --max-batch limit"
            return f"a plain step {step * 1e3:.0f} ms{short}"
        rows *= 2


def non_sampled_cost(model, base: float) -> None:
    """With a loss (a scalar with a graph, as a training step's): the step keeps its ``detach()`` for the mean
    loss since the last sample (every 64 kept losses are summed on their device); without one, for comparison."""
    loss = torch.ones((), requires_grad=True) * 2.0
    for given in (loss, None):
        monitor = Monitor(model, every=1000, sinks=[MemorySink()])
        monitor.capture.disarm()
        n = 20000
        t0 = clock()
        for step in range(1, n + 1):
            if step % 1000:
                monitor.step(step, loss=given)
        per_call = (clock() - t0) / n
        monitor.close()
        print(f"3. one non-sampled monitor.step {'with' if given is not None else 'without'} a loss: "
              f"{per_call * 1e6:.2f} us = {per_call / base * 100:.5f}% of a step")


def _fwd_bwd(model, ids) -> float:
    t0 = clock()
    model(input_ids=ids, labels=ids).loss.backward()
    return clock() - t0


def _sample_costs(model, ids, signals: tuple[str, ...], reps: int) -> list[float]:
    """Seconds one sampled step of ``signals`` adds, for the first (cold) sample and ``reps`` warm ones:
    the sampled monitor.step, the next call (which measures the update ratios after a real AdamW
    step: at once, since these steps are within ``note_horizon``; later in a run that work moves to
    the next sampled step), and, with attention, the capture's time inside the armed forward."""
    monitor = Monitor(model, every=2, signals=signals, sinks=[MemorySink()])
    captured = timed_capture(monitor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    costs = []
    if 2 * reps + 1 >= monitor._updates_at_once:
        raise SystemExit(f"overhead.py: --reps {reps} reaches step {2 * reps + 1}; item 4 needs --reps < 25")
    for rep in range(reps + 1):
        if "attention" in signals:
            monitor.capture.arm()
        _fwd_bwd(model, ids)
        extra, captured[0] = captured[0], 0.0
        t0 = clock()
        monitor.step(2 * rep, loss=torch.tensor(1.0))  # sampled
        extra += clock() - t0
        opt.step()
        model.zero_grad(set_to_none=True)
        t1 = clock()
        monitor.step(2 * rep + 1)  # not sampled: dW, and the ratios at once (steps < note_horizon, 50)
        costs.append(extra + clock() - t1)
    monitor.close()
    return costs


def families(model, base: float, reps: int) -> None:
    """Each family alone (``signals=(family,)``; "loss": no family, the loss only), then all together:
    the first sample of a fresh Monitor (cold: no warm start for the update ratios' sigma_1, first
    buffers) and the median of ``reps`` warm ones 2 steps apart, as fractions of one training step."""
    print(f"4. sampled-step cost per signal family (fraction of one training step): {load()}")
    ids = torch.randint(0, 8192, BATCH, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for name, signals in (("loss", ()), ("grads", ("grads",)), ("spectra", ("spectra",)),
                          ("updates", ("updates",)), ("attention", ("attention",)), ("all", SIGNALS)):
        costs = _sample_costs(model, ids, signals, reps)
        warm = costs[1:]
        cold, med = costs[0] / base * 100, statistics.median(warm) / base * 100
        low, high = min(warm) / base * 100, max(warm) / base * 100
        print(f"   {name:>9}: first (cold) {cold:6.2f}%, warm {med:6.2f}% (min {low:.2f}, max {high:.2f}) {load()}")


def memory_child(size: str, monitored: bool, steps: int) -> None:
    """Child process of item 5: train ``steps`` steps, print the peak RSS in KiB."""
    model = build(size)
    monitor = Monitor(model, every=1, sinks=[MemorySink()]) if monitored else None
    train_steps(model, monitor, steps, 0)
    if monitor is not None:
        monitor.close()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def memory(size: str, reps: int, threads: int) -> None:
    peaks: dict[bool, list[int]] = {False: [], True: []}
    for _ in range(reps):
        for monitored in (False, True):
            cmd = [sys.executable, __file__, "--models", size, "--threads", str(threads), "--memory-child",
                   "monitored" if monitored else "plain"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            peaks[monitored].append(int(out.strip().splitlines()[-1]))
    plain, watched = statistics.median(peaks[False]), statistics.median(peaks[True])
    print(f"5. peak RSS over 4 training steps (every=1, all signals): without {plain / 1024:.0f} MiB, with "
          f"{watched / 1024:.0f} MiB: +{(watched - plain) / 1024:.0f} MiB = {(watched / plain - 1) * 100:+.1f}% "
          f"(each median of {reps} child processes); ratio {watched / plain:.3f} {load()}")


def attention_scaling(reps: int, lengths: tuple[int, ...], width: int, heads: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hooks.capture.capture import ENTROPY_ROWS

    torch.manual_seed(0)
    layers = 2
    cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=8192, n_positions=max(lengths))
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").to(DEVICE)
    monitor = Monitor(model, every=1, signals=("attention",), sinks=[MemorySink()])
    print(f"6. attention capture vs sequence length ({layers} layers x {heads} heads, d_model {width}, sdpa, "
          f"batch 1: one sequence captured): per sampled layer, as a share of the whole "
          f"model's forward and backward without the Monitor; default: entropy and sink share from "
          f"{ENTROPY_ROWS} rows spread through longer sequences, max logit in float32; every row: all of it in "
          f"float64 {load()}")
    for n in lengths:
        ids = torch.randint(0, 8192, (1, n), generator=torch.Generator().manual_seed(n)).to(DEVICE)
        _fwd_bwd(model, ids)
        costs: dict[str, list[float]] = {"default": [], "every row": []}
        plains = []
        for _ in range(reps):
            for name, rows in (("default", ENTROPY_ROWS), ("every row", None)):
                monitor.capture.entropy_rows = rows
                monitor.capture.arm()
                armed = _fwd_bwd(model, ids)
                results, problems = monitor.capture.take()
                plain = _fwd_bwd(model, ids)
                costs[name].append((armed - plain) / layers)
                plains.append(plain)
                model.zero_grad(set_to_none=True)
            assert len(results) == layers and not problems, problems
        plain = statistics.median(plains)
        shown = ", ".join(f"{name} {statistics.median(c) * 1e3:7.0f} ms = {statistics.median(c) / plain:6.3f}x"
                          for name, c in costs.items())
        print(f"   {n:5d} tokens: forward+backward {plain * 1e3:7.0f} ms; capture per sampled layer: {shown} "
              f"(median of {reps}) {load()}")
    monitor.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["small"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--everys", nargs="+", default=["default", "1", "10", "100"],
                        help="'default' (the per-family cadence) and/or integers")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--width", type=int, default=256, help="item 6: d_model")
    parser.add_argument("--heads", type=int, default=8, help="item 6: attention heads")
    parser.add_argument("--only", nargs="+", choices=["1", "2", "3", "4", "5", "6"], default=None,
                        help="run only these items (item 3 and 4 need item 2's step time: it runs too)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="time every figure in this process's CPU time (default) or wall time")
    parser.add_argument("--paired", action="store_true",
                        help="item 2 with paired steps (a watched and a plain copy of the model, one step of "
                             "each in turn) instead of back-to-back windows")
    parser.add_argument("--blocks", type=int, default=0,
                        help="with --paired: one run of this many sampling periods, a time ratio per period")
    parser.add_argument("--data", choices=["fixed", "text", "stuck"], default="fixed",
                        help="items 2-4: one random batch at every step (default), the standard library's source "
                             "as text, or that text with the labels of other windows (a loss that is stuck)")
    parser.add_argument("--device", default="cpu",
                        help="the device the model trains on (cuda: wall time after a synchronisation; items 1-4, 6)")
    parser.add_argument("--batch", type=int, nargs=2, default=[4, 128], metavar=("SEQUENCES", "TOKENS"),
                        help="items 2-4: the training batch")
    parser.add_argument("--min-step-ms", type=float, default=0.0,
                        help="items 2-4: double the batch's sequences until a plain training step takes this long")
    parser.add_argument("--max-batch", type=int, default=1024, help="with --min-step-ms: at most this many sequences")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="items 2-4: AdamW's learning rate (e.g. 3e-3 for a run whose attention collapses)")
    parser.add_argument("--sink-only", action="store_true",
                        help="item 2: the Monitor writes to a MemorySink only, no logdir (default: a logdir in a "
                             "temporary folder, as the README's first example; removed after each run)")
    parser.add_argument("--memory-child", choices=["plain", "monitored"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    global CLOCK, DEVICE, DATA, BATCH, LR, SINK_ONLY
    CLOCK, DEVICE, DATA, BATCH = args.clock, args.device, args.data, tuple(args.batch)
    LR, SINK_ONLY = args.lr, args.sink_only
    if DEVICE != "cpu" and "5" in set(args.only or "123456"):
        parser.error("--device other than cpu measures items 1-4 and 6 only (5 is the host's memory): pass --only")
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.models[0], args.memory_child == "monitored", 4)
        return
    only = set(args.only or "123456")
    for size in args.models if only - {"6"} else ():  # item 6 builds its own model
        BATCH = tuple(args.batch)
        model = build(size)
        found = f" ({calibrate(model, args.min_step_ms, args.max_batch)})" if args.min_step_ms else ""
        layers, heads, width = SHAPES[size]
        on = f"on {torch.cuda.get_device_name()}" if DEVICE.startswith("cuda") else f"{args.threads} threads"
        print(f"model: GPT-2 shape {layers} layers x {heads} heads, d_model {width}; batch {BATCH[0]} x {BATCH[1]}"
              f"{found}; {on} {load()}")
        if "1" in only:
            spectra(model, args.reps)
        if only & {"2", "3", "4"}:
            if args.paired and args.blocks:
                base = paired_blocks(model, args.blocks, args.steps, args.everys)
            else:
                run = paired_overhead if args.paired else overhead
                base = run(model, args.reps, args.steps, args.everys)
            if "3" in only:
                non_sampled_cost(model, base)
            if "4" in only:
                families(model, base, args.reps)
        if "5" in only:
            memory(size, args.reps, args.threads)
    if "6" in only:
        attention_scaling(args.reps, tuple(args.lengths), args.width, args.heads)


if __name__ == "__main__":
    main()
