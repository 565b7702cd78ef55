"""Start-up allocates only what a rank owns: a llama3-8b-shaped block built on fsdp4 or tp4 CPU ranks allocates at
most its share of the parameters plus one (1024, 1024) tile of the initial-value grid, and the weights are the same
as one process's (the tiles are a function of (seed, name, tile), not of the layout)."""

import pytest
import torch
from torch.nn import ModuleList

import model
from bench.ranks import run_ranks
from parallel import ddp, fsdp, tp
from parallel.materialize import TILE, local_init, materialize
from parallel.mesh import Mesh
from tests.memory import LiveBytes

BLOCK_8B = model.ModelConfig(n_layer=1, d_model=4096, n_head=32, n_kv_head=8, ffn_dim=14336, vocab_size=512, seq_len=64)
TILE_BYTES = TILE ** 2 * 4


def _build(rank, world, mode):
    mesh = Mesh(rank, world, tp=world if mode == "tp4" else 1)
    with torch.device("meta"):
        gpt = model.GPT(BLOCK_8B)
    if mode == "tp4":
        tp.parallelize(gpt, mesh)

    def init_param(name, meta, flat=None, out=None):
        return local_init(name, meta, BLOCK_8B, 0, flat, out)
    module = ModuleList([gpt])
    with LiveBytes() as peak:  # the weights' materialization (DDP allocates its gradient buckets after it)
        if mode == "fsdp4":
            wrapper = fsdp.wrap(module, mesh, "cpu", init_param)
        else:
            materialize(module, "cpu", lambda name, p, out: init_param(name.split(".", 1)[1], p, out=out))
    wrapper = wrapper if mode == "fsdp4" else ddp.DDP(module, mesh)
    share = sum(p.numel() * 4 for p in wrapper.optim_params())
    probe = {}  # a few elements of every tensor, to compare with one process
    for piece in wrapper.owned_pieces():
        values = piece.param.detach().reshape(-1)[piece.start:piece.end]
        probe[(piece.name, piece.offset, piece.tp_shard)] = values[:64].clone().numpy()
    return peak.peak, share, probe


@pytest.mark.parametrize("mode", ["fsdp4", "tp4"])
def test_a_rank_allocates_its_share_and_one_tile(mode):
    for rank, (peak, share, probe) in enumerate(run_ranks(_build, 4, args=(mode,), timeout=300)):
        assert peak <= share + TILE_BYTES, f"rank {rank}: {peak / 1e6:.1f} MB > share {share / 1e6:.1f} MB + a tile"
        assert share < 0.3 * 4 * model.param_counts(BLOCK_8B)[0]  # a quarter of the block's fp32 weights, not all
        for (name, offset, tp_shard), values in list(probe.items())[:6]:
            meta = torch.empty(_local_shape(name, tp_shard), device="meta")
            if tp_shard is not None:
                meta.tp_shard = tuple(tp_shard)
            expected = local_init(name, meta, BLOCK_8B, 0, range(offset, offset + len(values)))
            assert torch.equal(torch.from_numpy(values), expected), (rank, name)


def _local_shape(name, tp_shard):
    with torch.device("meta"):
        shape = list(dict(model.GPT(BLOCK_8B).named_parameters())[name].shape)
    if tp_shard is not None:
        shape[tp_shard[0]] //= tp_shard[2]
    return shape
