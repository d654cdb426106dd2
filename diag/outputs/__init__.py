"""Outputs: the tag scheme, records, sinks (TensorBoard, JSONL, alerts), the TensorBoard layout and images.

A new sink goes here.
"""
