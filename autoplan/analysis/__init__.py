"""Questions about plans: what-if sweeps over clusters, explanations, timelines and plots.

Reads plans and estimates; runs the planner; never builds a distributed job.
"""
