"""Outputs: records, sinks (TensorBoard, JSONL, alerts), the TensorBoard layout and images (tags: diag.catalog).

A new sink goes here.
"""
