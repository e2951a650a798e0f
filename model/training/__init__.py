"""The rank-side training runtime: the program every torchrun worker runs (`worker.py`), the
packed-shard format (`shards.py`, written by the data stage) and its resumable loader
(`loader.py`), the loop that decides when things happen (`loop.py`), the step that decides what
one does (`step.py`), the loop's callbacks (`callbacks.py`), the optimizer and LR schedule
(`optim.py`), fp16 loss scaling (`amp.py`), metrics (`metrics.py`), preemption (`preemption.py`:
a signal saves the step and ends the loop), alert lines for the launcher to post (`alerts.py`)
and the files a run keeps in its output directory (`outputs.py`).

Imports configs and the rest of model/ (architecture, parallel/, checkpoint/); nothing above.
"""
