"""Data a run reads and writes: token shards, saves, the run folder, Hugging Face folders."""


class DataError(Exception):
    """A data file or folder is missing or malformed: one line naming it, exit status 2."""
    exit_status = 2


class SaveError(Exception):
    """A missing, corrupt or mismatched save, or another run's folder: one line, exit status 2."""
    exit_status = 2


class TrainingFailure(Exception):
    """The run stopped itself: one line, exit status 3."""
    exit_status = 3
