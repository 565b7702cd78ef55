"""Data a run reads and writes: token shards, saves, the run folder, Hugging Face folders.

Here too: the errors every command stops with, one line each, and their exit statuses."""
import argparse


class DataError(Exception):
    """A data file or folder is missing or malformed: one line naming it, exit status 2."""
    exit_status = 2


class SaveError(Exception):
    """A missing, corrupt or mismatched save, or another run's folder: one line, exit status 2."""
    exit_status = 2


class TrainingFailure(Exception):
    """The run stopped itself: one line, exit status 3."""
    exit_status = 3


class UsageError(ValueError):
    """A bad command line: printed as one line, exit status 2."""
    exit_status = 2


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose error is a UsageError: one line, no usage block."""

    def error(self, message):
        raise UsageError(message.removeprefix("argument "))
