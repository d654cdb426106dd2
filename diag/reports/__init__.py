"""The two HTML reports, built from the same page parts (:mod:`diag.reports.html`): a live run's from its
``metrics.jsonl`` and ``alerts.jsonl`` (:mod:`diag.reports.run`, ``python -m diag report``) and a checkpoint
analysis's (:mod:`diag.reports.checkpoints`, ``python -m diag analyze``). Both read each metric's title, unit
and range from the catalog (:mod:`diag.catalog.metrics`). The command line, the ``diag`` facade and the Monitor
(inside ``hooks.monitor.monitor.write_report``, for the sinks that log the run report) import them; nothing below
them does."""
