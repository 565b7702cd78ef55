"""Saving and resuming a run: atomic files, the last `keep` kept, a config check on resume.

A checkpoint is RUN_DIR/ckpt_STEP.pt holding the model and optimizer state, the loss scaler, the
step (the data position follows from it: batches are a function of (seed, step)), the RNG states and
the full config. It is written to a temp file, fsynced, then renamed, so a crash mid-save leaves the
previous checkpoint intact and the half-written temp file is ignored.
"""
import os
import random
from pathlib import Path

import numpy as np
import torch

PREFIX = "ckpt_"


class CheckpointError(Exception):
    """A missing, corrupt or mismatched checkpoint."""


def checkpoints(run_dir):
    """Complete checkpoints in the run folder, oldest first."""
    return sorted(Path(run_dir).glob(f"{PREFIX}*.pt"))


def rng_state():
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(run_dir, step, state, keep=2):
    """Atomically writes ckpt_STEP.pt and deletes all but the newest `keep`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{PREFIX}{step:07d}.pt"
    tmp = run_dir / f".tmp_{path.name}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in checkpoints(run_dir)[:-keep]:
        old.unlink()
    return path


def load(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from None


def load_latest(run_dir):
    found = checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint in {run_dir}")
    return load(found[-1])


def check_config(saved, current):
    """Refuses to resume under a different model or optimization config."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise CheckpointError(f"--resume: checkpoint has {key}={saved.get(key)!r}, "
                                  f"this run has {current.get(key)!r}")


def load_model_state(run_dir):
    """(config, full model state dict) of the newest checkpoint, for export and sampling."""
    state = load_latest(run_dir)
    return state["config"], state["model"]
