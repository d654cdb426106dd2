"""Post-hoc analysis: checkpoint formats and loaders, the series over checkpoints (its report: diag.reports).

A new checkpoint format goes here.
"""
