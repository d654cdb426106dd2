"""Helpers shared by the tests: the model zoo, attention styles, slow references, the monitored-step harness."""
