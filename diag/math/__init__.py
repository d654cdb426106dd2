"""Pure tensor math: spectra of Wq^T Wk, attention statistics, update ratios, gradient norms.

Given tensors, no nn.Module, no I/O. A new metric goes here.
"""
