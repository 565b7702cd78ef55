"""--compile trains what eager trains in every layout family, and compiles each part once.

Each set of ranks trains its layouts one after another, eager then compiled; torch._dynamo.reset() before each run
makes it compile as a fresh process would (Inductor's graph cache on disk still serves a graph that another layout
or rank compiled first). Every rank holds 10 blocks, more than dynamo's recompile limit of 8: a block compiled once per
block fails the run (fail_on_recompile_limit_hit) instead of falling back to eager. Collectives, FSDP's gather/free
bookkeeping and the pipeline's hand-offs stay outside the graphs, and on CPU so do ring attention's kernel calls
(parallel/ring_attention.py). One process compiles 4 graphs and breaks none: the blocks', the embedding's, the final
norm's and the loss's."""
import tempfile
import traceback

import pytest
import torch._dynamo
from torch._dynamo.utils import counters

import train
from bench.ranks import run_ranks
from tests.layouts import BASE, assert_same_losses

FLAGS = ["--steps", "3", "--n-layer", "10"]
PP_FLAGS = ["--steps", "3", "--n-layer", "20"]  # 10 blocks a pipeline rank
SETS = {  # name: (world, flags, {layout: flags})
    "one process": (1, FLAGS, {"one process": [], "selective": ["--ckpt", "selective"], "fp8": ["--dtype", "fp8"]}),
    "two ranks": (2, FLAGS, {
        "ddp": [], "fsdp": ["--dp-mode", "fsdp"],
        "hsdp": ["--dp-mode", "hsdp", "--dp-shard", "1"],  # shard groups of one rank, replicated over two
        "tp": ["--tp", "2"], "tp+sp": ["--tp", "2", "--sp"],
        "tp+sp selective": ["--tp", "2", "--sp", "--ckpt", "selective"],
        "cp ring": ["--cp", "2"], "cp ulysses": ["--cp", "2", "--cp-mode", "ulysses"],
        "cp allgather": ["--cp", "2", "--cp-mode", "allgather"], "fp8 tp": ["--tp", "2", "--dtype", "fp8"]}),
    "pipeline": (2, PP_FLAGS, {
        "pp 1f1b": ["--pp", "2"], "pp interleaved": ["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual", "2"],
        "pp zb1": ["--pp", "2", "--pp-schedule", "zb1"]}),
}
LAYOUTS = [(s, name) for s, (_, _, layouts) in SETS.items() for name in layouts]
# fp8 runs in bf16 autocast, and Inductor fuses bf16 ops without rounding to bf16 between them: compiled and eager
# differ by bf16 roundings, which an fp8 cast turns into e4m3 ones, as between fp8 layouts (tests/test_fp8.py)
FP8_RTOL = 1e-2


def _train_each(rank, world, argvs):
    """Every run's losses and the graphs and graph breaks dynamo counted in it; a run that raises gives its traceback
    instead, for its layout's test to report (the ranks go on with the next run)."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    results = []
    for argv in argvs:
        torch._dynamo.reset()
        counters.clear()
        try:
            losses = train.main(argv)
        except BaseException:  # noqa: BLE001 - SystemExit too: reported by the test of that layout
            results.append(traceback.format_exc())
            continue
        results.append((losses, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    return results


def train_set(name):
    """{layout: {compiled: (losses, graphs, graph breaks) or a traceback}}, from rank 0 of the set's ranks."""
    world, flags, layouts = SETS[name]
    with tempfile.TemporaryDirectory() as tmp:
        argvs = [BASE + flags + layout + ["--out", f"{tmp}/{i}{c}"] + ["--compile"] * c
                 for i, layout in enumerate(layouts.values()) for c in (0, 1)]
        results = iter(run_ranks(_train_each, world, args=(argvs,), timeout=900)[0])
    return {layout: {False: next(results), True: next(results)} for layout in layouts}


@pytest.fixture(scope="module")
def trained():
    """The runs of each set, trained when a test first asks for one of its layouts (-k runs only the sets it needs)."""
    sets = {}

    def get(layout, compiled):
        if layout[0] not in sets:
            try:
                sets[layout[0]] = train_set(layout[0])
            except Exception as e:  # noqa: BLE001 - ranks that die or hang fail the set's tests, trained once
                sets[layout[0]] = e
        if isinstance(sets[layout[0]], Exception):
            raise sets[layout[0]]
        got = sets[layout[0]][layout[1]][compiled]
        assert not isinstance(got, str), f"{layout[1]} {'compiled' if compiled else 'eager'} failed:\n{got}"
        return got
    return get


@pytest.mark.parametrize("layout", LAYOUTS, ids=[name for _, name in LAYOUTS])
def test_compiled_parts_train_like_eager_without_recompiling(layout, trained):
    rtol = FP8_RTOL if "fp8" in layout[1] else 1e-4
    assert_same_losses(trained(layout, True)[0], trained(layout, False)[0], rtol=rtol)


def test_one_process_compiles_block_embedding_norm_and_loss_in_four_graphs(trained):
    _, graphs, breaks = trained(("one process", "one process"), True)
    assert (graphs, breaks) == (4, 0)
