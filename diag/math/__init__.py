"""Pure tensor math: spectra of Wq^T Wk, sigma_1 estimators, attention statistics, update ratios, gradient norms.

Given tensors, no nn.Module, no I/O. ``spectral`` (per-head spectra and their summaries), ``norms`` (sigma_1:
exact, block Krylov, power iteration; Frobenius), ``attention`` (entropy, rank, max logit), ``metrics`` (the
per-layer families), ``updates`` (the snapshot/update routine and update ratios). A new metric goes here.
"""
