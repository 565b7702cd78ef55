"""The loader checks the shards it reads, not what meta.json says about them: a shard edited in place, which keeps
its size, is refused when it holds an id past the vocabulary."""
import numpy as np
import pytest

from data.loader import DataError, TokenLoader
from data.text import prepare_text


@pytest.mark.parametrize("bad", [300, 65535])  # below the padded embedding table (320 rows), beyond it
def test_a_shard_edited_in_place_is_refused(tmp_path, bad):
    """Was: a shard that kept its size was trusted to hold meta.json's recorded maximum, so its ids past the
    vocabulary trained silently (below the padded table) or crashed with an IndexError (beyond it)."""
    (tmp_path / "in.txt").write_text("a few words of text, enough for a window or two\n" * 4)
    out = tmp_path / "out"
    prepare_text([tmp_path / "in.txt"], out, "bytes", val_fraction=0)
    path = out / "text_train_000000.bin"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(1024 + 2 * 7)
        f.write(np.array([bad], dtype="<u2").tobytes())
    assert path.stat().st_size == size
    with pytest.raises(DataError, match=rf"text_train_000000.bin: token id {bad} is outside the vocabulary "
                                        r"\(vocab_size 257 in .*meta.json; it records 256 for this shard"):
        TokenLoader(out, "train", 16, 2, 0, prefetch=False)
