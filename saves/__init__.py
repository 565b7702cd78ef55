"""Saves of a run: what train.py writes to disk and reads back, in any layout. (Activation checkpointing, which
recomputes activations in backward and writes nothing, is parallel/ckpt.py.)

    RUN/step_0000100/        one complete save (the step, 7 digits)
        meta.json            rank 0: format (3), step, config, layout, loss scaler, Adam's step count, every rank's
                             RNG states, the size of every file, and for every global tensor its shape, dtype and
                             pieces; a piece names its file (a plain name in this folder), and for the param and
                             each Adam moment its byte offset and the CRC-32 of its bytes, started from what
                             they are, so that each piece checks on its own (integrity.py)
        rank00003.bin        rank 3's raw bytes: for each piece it writes, the param, then exp_avg and exp_avg_sq
        complete             written last (the step)
    RUN/attempts.json        one record per attempt of the run (restarts.py)
    RUN/metrics.jsonl, RUN/.lock   train.py's metrics; who holds the folder (run.py)

write.py     every rank writes only the pieces it owns (parallel/__init__.py's Piece), sync or async, atomically;
             a failed save (a full disk) stops every rank alike and removes itself
load.py      loading any save into any layout (resuming is resharding); reading full tensors for export, sampling
integrity.py what a save must be before it is trusted: meta.json's keys and bounds, plain file names, sizes,
             checksums, a step that agrees with its folder
restarts.py  torchrun restarts, attempt records, the non-finite-loss stop
export.py    python -m saves.export RUN OUT: a Hugging Face Llama folder
hf.py        --init-from: reading one, its config.json checked against the run's model
run.py       the run folder: its lock, its checks, whose it is
Files are written atomically and read only when regular (data/files.py: saves/ imports data/, never the reverse).
"""


class SaveError(Exception):
    """A missing, corrupt or mismatched save, or a run folder that is not this run's: one line, exit status 2."""


class TrainingFailure(Exception):
    """The run stopped itself: one line, exit status 3 (saves.restarts.TrainingFailure is this class)."""
