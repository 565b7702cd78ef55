"""Initial weights that do not depend on the layout, made one rank's part at a time.

A weight's initial value is drawn tile by tile over a fixed grid of (1024, 1024) tiles. Each tile
is a function of (seed, name, tile index) only. So any rank can make any part of any weight, and
every layout starts from the same model as one process.

A part is a tp block (the `tp_shard` tag, parallel/__init__.py), and of that block, for an FSDP
shard, a range of its flattened elements. A rank allocates its part and one tile, never a weight.
"""
import hashlib
import math

import torch

from model import init_std

TILE = 1024


def init_tile(name, rows, cols, cfg, seed):
    """One tile of a weight's initial value (rows, cols: ranges of the global matrix), fp32, CPU."""
    where = f"{seed}/{name}/{rows.start}/{cols.start}".encode()
    key = hashlib.blake2b(where, digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return torch.randn((len(rows), len(cols)), generator=gen).mul_(init_std(name, cfg))


def local_init(name, param, cfg, seed, flat=None, out=None):
    """This rank's part of one parameter's initial value, written into `out` when given.

    param: the meta parameter, maybe tagged tp_shard. flat: an FSDP shard's range of the block's
    flattened elements (the result is then 1-D), or None for the whole block."""
    dim, rank, world = getattr(param, "tp_shard", (0, 0, 1))
    rows = param.shape[0] if param.dim() else 1
    cols = math.prod(param.shape[1:])  # the tp block as a (rows, cols) matrix
    whole = flat is None
    flat = range(rows * cols) if whole else flat
    out = torch.empty(len(flat)) if out is None else out
    if name.endswith("norm.weight"):
        return out.fill_(1.0).view(param.shape) if whole else out.fill_(1.0)
    n_rows, n_cols = (rows * world, cols) if dim == 0 else (rows, cols * world)  # the global matrix
    row0, col0 = (rank * rows, 0) if dim == 0 else (0, rank * cols)  # where the block sits in it
    first, last = flat.start // cols, -(-flat.stop // cols)  # block rows the range touches
    full_lo, full_hi = -(-flat.start // cols), flat.stop // cols  # block rows it covers whole
    for r in range((row0 + first) // TILE * TILE, row0 + last, TILE):
        for c in range(col0 // TILE * TILE, col0 + cols, TILE):
            tr, tc = range(r, min(r + TILE, n_rows)), range(c, min(c + TILE, n_cols))
            tile = init_tile(name, tr, tc, cfg, seed)
            lr0, lr1 = tr.start - row0, tr.stop - row0  # the tile's rows and columns in the block
            lc0, lc1 = max(tc.start - col0, 0), min(tc.stop - col0, cols)
            tile = tile[:, lc0 + col0 - tc.start:lc1 + col0 - tc.start]  # (tile rows, lc1 - lc0)
            a, b = max(lr0, full_lo), min(lr1, full_hi)
            if b > a:  # whole rows of the range: one 2-D copy
                rows_out = out[a * cols - flat.start:b * cols - flat.start].view(b - a, cols)
                rows_out[:, lc0:lc1] = tile[a - lr0:b - lr0]
            for row in {first, last - 1} - set(range(full_lo, full_hi)):  # at most two partial rows
                lo, hi = max(flat.start, row * cols + lc0), min(flat.stop, row * cols + lc1)
                if lr0 <= row < lr1 and hi > lo:
                    c0, c1 = lo - row * cols - lc0, hi - row * cols - lc0  # its columns in the tile
                    out[lo - flat.start:hi - flat.start] = tile[row - lr0, c0:c1]
            del tile  # before the next one is drawn: one tile alive at a time
    return out.view(param.shape) if whole else out


@torch.no_grad()
def materialize(module, device, init_param):
    """Meta parameters -> real ones on `device`, each filled by init_param(name, param, out=view).
    Their tags carry over. A Parameter held in two places (a tied head) stays one."""
    tags = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    places = {}  # id of a Parameter -> the names it is held under, the first as listed
    for name, p in module.named_parameters(remove_duplicate=False):
        places.setdefault(id(p), []).append(name)
    module.to_empty(device=device)  # gives every place its own tensor
    for first, *others in places.values():
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(first))
    for name, p in module.named_parameters():
        p.__dict__.update(tags[name])
        init_param(name, p, out=p.view(-1))
    return module


def init_weights(model, seed, device):
    """A meta-device GPT materialized whole on `device` with the layout-independent weights."""
    cfg = model.cfg
    return materialize(model, device, lambda name, p, out: local_init(name, p, cfg, seed, out=out))
