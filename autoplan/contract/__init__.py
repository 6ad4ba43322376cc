"""The data every layer shares: the Plan and its file format, the traced ModelGraph, the
error types and the op vocabulary. Imports only `cost_model` (and `autoplan._format`).
"""
