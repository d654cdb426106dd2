"""A sampled step's solver calls and host reads do not grow with the layers or the captured attention calls.

On an accelerator every host read, and every eigensolver or SVD call (torch checks the solver's status on the
host), synchronises the device with the host. So a sampled step batches every layer's attention ranks into one
eigensolver call (:func:`diag.math.attention.solve_ranks`), every layer's spectra into one per shape, and
decides on the device what it used to decide on the host (padded rows, non-finite heads). These tests count the
calls with a ``TorchFunctionMode`` on the CPU: what a GPU would time, CI guards by counting. The counts are the
Monitor's own: those of a step that samples nothing (the model's own calls) are subtracted.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from diag.outputs.sinks import MemorySink
from hooks import Monitor

HOST_READS = {"__bool__", "item", "tolist", "cpu", "__float__", "__int__", "__index__", "nonzero"}
# torch.linalg's decompositions check their solver's status on the host (vector norms are reductions: not counted)
SOLVERS = {"linalg_eigvalsh", "linalg_eigh", "linalg_svd", "linalg_svdvals", "linalg_cholesky", "linalg_cholesky_ex",
           "linalg_matrix_norm", "linalg_qr", "linalg_eig", "linalg_eigvals", "svd", "symeig"}


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.host: Counter = Counter()
        self.solvers: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.host[name] += 1
        if name in SOLVERS:
            self.solvers[name] += 1
        return func(*args, **(kwargs or {}))


def _counts(layers: int, seqs: int, attn: str, steps: tuple[int, ...]) -> dict[int, tuple[Counter, Counter]]:
    """The Monitor's host reads and solver calls at ``steps`` of a GPT-2 run (padding in the first sequence):
    each step's counts less those of step 99, which samples nothing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=layers, n_head=4, attn_pdrop=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation=attn)
    monitor = Monitor(model, sinks=[MemorySink()], images=False, attn_seqs=seqs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    counted = {}
    for step in range(max(steps) + 1):
        ids = torch.randint(0, 64, (3, 32), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, 20:] = 0
        with _Count() as count:
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            monitor.step(step, loss=loss)
        counted[step] = count
        opt.step()
        opt.zero_grad()
    monitor.close()
    base = counted[99]
    return {s: (counted[s].host - base.host, counted[s].solvers - base.solvers) for s in steps}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_solver_calls_and_host_reads_per_sample_do_not_grow_with_layers_or_captured_calls(attn):
    """Step 100 samples every family (attention of every layer, spectra, gradient norms, the update snapshot);
    step 110 the loss, gradient norms and spectra, and measures step 100's update ratios."""
    steps = (100, 110)
    runs = {(layers, seqs): _counts(layers, seqs, attn, steps) for layers, seqs in ((2, 1), (5, 1), (5, 3))}
    for step in steps:
        host = {key: sum(run[step][0].values()) for key, run in runs.items()}
        solvers = {key: sum(run[step][1].values()) for key, run in runs.items()}
        assert len(set(host.values())) == 1, (step, host, {k: r[step][0] for k, r in runs.items()})
        assert len(set(solvers.values())) == 1, (step, solvers, {k: r[step][1] for k, r in runs.items()})
        assert max(host.values()) <= 4 and max(solvers.values()) <= 4, (step, runs[(5, 3)][step])
    # the attention ranks of every layer and sequence: one eigensolver call; the spectra another
    assert runs[(5, 3)][100][1]["linalg_eigvalsh"] == 2, runs[(5, 3)][100][1]


def test_ranks_solved_within_the_capture_once_their_grams_pass_the_budget_are_the_same(monkeypatch):
    """The Grams a capture holds stay bounded: past ``SOLVE_BYTES`` of them the pending ranks are solved inside the
    forward (here at every layer), with the same values as one solve at the end."""
    import hooks.capture.capture as capture

    def attention(sink: MemorySink) -> dict:
        return {(r.step, t): v for r in sink.records for t, v in r.scalars.items() if t.startswith("attn_")}

    def run() -> dict:
        from tests.support import zoo

        case = zoo.gpt2(dropout=0.0)
        sink = MemorySink()
        monitor = Monitor(case.model, sinks=[sink], images=False, every=2)
        gen = torch.Generator().manual_seed(0)
        for step in range(5):
            case.loss(case.model, case.make_batch(gen)).backward()
            monitor.step(step)
            case.model.zero_grad(set_to_none=True)
        monitor.close()
        return attention(sink)

    whole = run()
    monkeypatch.setattr(capture, "SOLVE_BYTES", 1)
    with _Count() as count:
        each = run()
    assert whole and each == whole
    assert count.solvers["linalg_eigvalsh"] >= 2 * 3  # 2 layers solved apart at each of 3 attention samples
