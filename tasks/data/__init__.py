"""The data stage: reading the sources (`sources.py`), the snapshot of the raw inputs DVC
tracks (`snapshot.py`), cleaning and deduplication (`clean.py`), and the build from the
snapshot to tokenizer, packed shards and manifest (`build.py`). The shard format itself is
model/training/shards.py, beside the loader that reads it.

Imports configs, model and the rest of tasks/ (atomic files, tracking, the stage records).
"""
