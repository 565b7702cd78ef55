"""What the tests count that the algorithms do not: from the collective log, or a test-side hook.

    all_reduces_launched(mesh)     DDP's bucket all-reduces launched so far (after backward: in it)
    with fsdp_gathers() as counts  FSDP's all-gathers by the pass that waits for them
    pp.execute(..., runner=InFlight).max_in_flight    most activation sets a stage held at once
"""
from collections import Counter
from contextlib import contextmanager
from unittest import mock

from parallel import fsdp, pp


def all_reduces_launched(mesh, group="dp_cp"):
    """The all-reduces launched so far on a group, read from the collective log."""
    return sum(kind == "all_reduce" and name == group for kind, name, _ in mesh.stats.log)


@contextmanager
def fsdp_gathers():
    """{"forward": n, "backward": n}: FSDP's all-gathers by the pass that first waits for each. A
    checkpointed block's recompute is backward's; the embedding prefetched in backward is the
    next forward's."""
    counts, wait = Counter(), fsdp.Unit.wait_gathered

    def counted(unit):
        if unit.full is None:  # a gather completes here
            counts["backward" if fsdp.in_backward() else "forward"] += 1
        return wait(unit)
    with mock.patch.object(fsdp.Unit, "wait_gathered", counted):
        yield counts


class InFlight(pp.Pipeline):
    """A Pipeline that notes the most activation sets alive at once (forwards awaiting B or W)."""
    max_in_flight = 0

    def forward(self, a, received):
        super().forward(a, received)
        self.max_in_flight = max(self.max_in_flight, len(self.alive))
