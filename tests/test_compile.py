"""--compile (torch.compile of each block) trains what eager trains, and compiles each block once: on 10 blocks,
more than dynamo's recompile limit of 8, a recompiling frame fails the run instead of falling back to eager.
Under tp with sequence parallel the block holds custom autograd Functions and collectives; under fsdp it is
wrapped by the gather/free bookkeeping, which must stay outside the compiled graph."""
import tempfile

import pytest
import torch._dynamo

import train
from tests.layouts import BASE, assert_same_losses
from tests.ranks import run_ranks

FLAGS = ["--steps", "3", "--n-layer", "10"]


def _train(rank, world, argv):
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return train.main(argv)


@pytest.mark.parametrize("layout", [["--tp", "2", "--sp"], ["--dp-mode", "fsdp"]], ids=["tp2-sp", "fsdp2"])
def test_compiled_blocks_train_like_eager_without_recompiling(layout):
    losses = {}
    for compiled in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            argv = BASE + FLAGS + layout + ["--out", tmp] + ["--compile"] * compiled
            losses[compiled] = run_ranks(_train, 2, args=(argv,), timeout=600)[0]
    assert_same_losses(losses[True], losses[False], rtol=1e-4)
