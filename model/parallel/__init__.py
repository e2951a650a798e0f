"""Parallelism, applied to the model from outside: the named DeviceMesh and precision of the
running job (`mesh.py`), one function per technique -- `apply_tp`, `apply_ac`, `apply_compile`,
`apply_fsdp` (`parallelize.py`) -- the pipeline split and schedules (`pipelining.py`), and the
layout planner that reasons about all of them before any accelerator is booked (`planner.py`).

The layout itself (degrees and the rules they obey) is `ParallelConfig` in configs. Imports
configs and the architecture; nothing above.
"""
