"""Checkpointing and storage tiers: sharded torch.distributed.checkpoint saves with a commit
protocol and resume from the latest valid one (`manager.py`), and the persistent tier they are
uploaded to and pulled back from (`tiers.py`).

Imports configs and the model's file helpers only; the training runtime, inference and the
train stage build on it.
"""
