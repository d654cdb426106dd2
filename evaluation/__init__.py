"""The evaluation behind the docs' tables: recordings, replays and sweeps, run from a checkout as
``python -m evaluation.<module>`` (not installed with the package)."""
