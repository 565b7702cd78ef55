"""Saves of a run: what train.py writes to disk and reads back, in any layout.

Activation checkpointing recomputes activations in backward and writes nothing: parallel/ckpt.py.

    RUN/step_0000100/        one complete save (the step, 7 digits)
        meta.json            rank 0: format (3), step, config, layout, loss scaler, Adam's step
                             count, every rank's RNG states, and the size of every file. For every
                             global tensor: its shape, dtype and pieces. A piece names its file
                             (a plain name in this folder). For the param and each Adam moment
                             it holds a byte offset and the CRC-32 of those bytes, seeded with
                             what the piece is, so each piece checks on its own (integrity.py).
        rank00003.bin        rank 3's raw bytes: per piece it writes, the param, exp_avg, exp_avg_sq
        complete             written last (the step)
    RUN/attempts.json        one record per attempt of the run (restarts.py)
    RUN/metrics.jsonl, RUN/.lock   train.py's metrics; who holds the folder (run.py)

write.py     each rank writes only the pieces it owns (parallel/__init__.py's Piece),
             sync or async, atomically. A failed save (a full disk) stops every rank alike,
             and removes itself.
load.py      any save into any layout (resuming is resharding); full tensors for export, sampling
integrity.py what a save must be before it is trusted: meta.json's keys and bounds, plain file
             names, sizes, checksums, a step that agrees with its folder
restarts.py  torchrun restarts, attempt records, the non-finite-loss stop
export.py    python -m saves.export RUN OUT: a Hugging Face Llama folder
hf.py        --init-from: reading one, its config.json checked against the run's model
run.py       the run folder: its lock, its checks, whose it is
Files are written atomically and read only when regular (data/files.py).
saves/ imports data/, never the reverse.
"""


class SaveError(Exception):
    """A missing, corrupt or mismatched save, or another run's folder: one line, exit status 2."""


class TrainingFailure(Exception):
    """The run stopped itself: one line, exit status 3 (saves.restarts.TrainingFailure is this)."""
