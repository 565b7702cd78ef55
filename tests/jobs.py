"""Several test jobs in one set of gloo ranks: start-up is paid once, and a failing job is reported, not fatal."""
import traceback


class Failed(str):
    """The traceback of a job that raised."""


def run_jobs(rank, world, jobs):
    """jobs: [(key, fn, args)]; runs fn(rank, world, *args) in turn and returns {key: result or Failed}."""
    results = {}
    for key, fn, args in jobs:
        try:
            results[key] = fn(rank, world, *args)
        except Exception:
            results[key] = Failed(traceback.format_exc())
    return results
