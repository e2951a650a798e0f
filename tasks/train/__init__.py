"""The train stage: the torchrun job and its result (`job.py`), the process-group runner that
launches it (`launch.py`) or the Slurm job that runs it (`slurm.py`), the posting of the ranks'
alerts (`alerts.py`), the loss curve (`curves.py`) and the operations on the checkpoint versions it
leaves (`versions.py`: `forgeline checkpoints ...`). The ranks themselves run
model/training/worker.py, which imports nothing of tasks/.

Imports configs, model and the rest of tasks/.
"""
