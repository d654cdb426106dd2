"""Live-model tools for the offline analysis (``python -m diag analyze``): the model built from a
Hugging Face ``config.json``, the layout search over it (``search``, with the scaled forwards of
``verdicts``) and the attention probe (``probe``, for ``--probe``)."""
