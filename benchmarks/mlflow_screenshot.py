"""docs/figures/mlflow_run.png: the MLflow UI on a short demo run written by MLflowSink.

    PYTHONPATH=. .venv/bin/python benchmarks/mlflow_screenshot.py            # ~1 min on 2 CPU cores
    PYTHONPATH=. .venv/bin/python benchmarks/mlflow_screenshot.py --chromium /usr/bin/chromium --out shot.png

Starts a local MLflow server (SQLite store, tests/support/mlflow_server.py), trains the demo's GPT for 60 steps
(every=10, the collapse setting) with a logdir and an MLflowSink, then opens the run's page in headless Chromium
through Playwright (``executable_path``: the Chromium already installed, no browser is downloaded) and saves a
screenshot of its metric charts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diag.outputs.mlflow_sink import MLflowSink  # noqa: E402
from hooks.demo import GPT, GPTConfig, encode, get_batch, load_text  # noqa: E402
from hooks.demo.loop import Schedule, adamw, train_steps  # noqa: E402
from hooks.demo.run import DEFAULT_LR  # noqa: E402
from hooks.monitor.monitor import Monitor  # noqa: E402
from tests.support.mlflow_server import mlflow_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium to drive (default: %(default)s)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures" / "mlflow_run.png"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp) / "server") as uri:
        cfg = GPTConfig()
        data, cfg.vocab_size = encode(load_text(500_000))
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        model = GPT(cfg)
        sink = MLflowSink(tracking_uri=uri, experiment="attnscope-demo", run_name="demo")
        monitor = Monitor(model, logdir=Path(tmp) / "run", every=10, sinks=[sink])
        try:
            train_steps(model, lambda: get_batch(data, cfg, gen), lambda b: model(*b), adamw(model, DEFAULT_LR),
                        args.steps, schedule=Schedule(0), monitor=monitor)
        finally:
            monitor.close()
        from mlflow.tracking import MlflowClient

        experiment = MlflowClient(uri).get_run(sink.run_id).info.experiment_id
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.goto(f"{uri}/#/experiments/{experiment}/runs/{sink.run_id}/model-metrics")
            page.wait_for_load_state("load")  # the UI polls the server: the network never goes idle
            page.wait_for_timeout(8000)
            close = page.get_by_role("button", name="Close", exact=True)
            if close.count() == 1:  # the assistant panel beside the charts
                close.click()
                page.wait_for_timeout(500)
            search = page.get_by_placeholder("Search metric charts")
            if search.count():  # the charts of one signal: sigma_1 of every layer
                search.first.fill("qk_sigma1")
            page.wait_for_timeout(5000)  # the charts draw after the data arrive
            page.screenshot(path=args.out)
            browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
