"""Measure this machine: device rates and links (`machine`), then the training stack's host
overheads from real runs of the runtime (`host_overheads`).
"""
