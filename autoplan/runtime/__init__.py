"""Run a plan: `parallelize` (build the distributed module on every rank), checkpoints, the
`Trainer` loop and torchft replica groups. Built on `passes`.
"""
