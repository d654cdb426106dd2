"""Post-hoc analysis: checkpoint formats and loaders, the series over checkpoints, the report.

A new checkpoint format goes here.
"""
