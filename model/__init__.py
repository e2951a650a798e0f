"""The model and everything that runs on a training rank.

This folder holds the architecture (`transformer.py`, layout-independent initialization in `init.py`),
its Hugging Face adapter (`hf.py`), single-process inference (`inference.py`), the durable
file helpers its formats share (`fileio.py`), a child's lifetime tied to its parent's
(`lifetime.py`) and the tracking spool every forgeline process
writes MLflow runs through (`spool.py`). Below it, one folder per layer of the rank side:

    parallel/     mesh, apply_tp / apply_ac / apply_compile / apply_fsdp, pipeline split, planner
    checkpoint/   sharded DCP checkpoints with a commit protocol, the persistent storage tier
    training/     the rank program torchrun launches: shard format and loader, loop, step,
                  callbacks, optimizer, metrics

Imports configs only (configs <- model <- eval <- tasks <- flows). The architecture modules
import nothing of parallel/, checkpoint/ or training/.
"""
