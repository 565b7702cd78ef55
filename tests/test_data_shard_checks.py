"""The loader checks the shards it reads, not what meta.json says about them: a shard edited in place, which keeps
its size, is refused when it holds an id past the vocabulary. And the shards are the ones meta.json records: a
foreign shard dropped in, a shard swapped for another of the same size, a recorded shard gone are refused by the
loader and by data_identity, what a resume compares."""
import hashlib
import json

import numpy as np
import pytest

import train
from data.loader import DataError, TokenLoader, data_identity, read_shard, write_shard
from data.text import prepare_text
from tests.layouts import BASE
from tests.test_checkpoint import quiet
from tests.test_save_integrity import exit_of, one_error_line


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


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"document {i}: enough words for a window"}) + "\n"
                                               for i in range(40)))
    out = tmp_path / "out"
    prepare_text([tmp_path / "in.jsonl"], out, "bytes", val_fraction=0.3)
    assert {p.name for p in out.glob("*.bin")} == {"text_train_000000.bin", "text_val_000000.bin"}
    return out


def test_a_foreign_shard_dropped_in_is_refused(prepared):
    """Was: trained on, and --resume accepted the folder, since its identity hashed meta.json alone."""
    identity = data_identity(prepared)
    foreign = prepared / "text_train_000001.bin"
    write_shard(foreign, np.arange(100) % 257)
    for call in (lambda: TokenLoader(prepared, "train", 16, 2, 0, prefetch=False), lambda: data_identity(prepared)):
        with pytest.raises(DataError) as e:
            call()
        assert str(e.value) == f"{foreign}: not a shard {prepared / 'meta.json'} records (a file put there after it " \
                               "was prepared?); remove it, or prepare the folder again"
    foreign.unlink()
    assert data_identity(prepared) == identity


def test_a_shard_swapped_for_one_of_another_tokenizer_is_refused(prepared):
    """Same size, ids inside the vocabulary (so no other check sees it): its fingerprint differs."""
    path = prepared / "text_train_000000.bin"
    tokens = np.asarray(read_shard(path))
    write_shard(path, (tokens * 7 + 1) % 256)  # another tokenizer's ids for the same text: the same count
    assert path.stat().st_size == 1024 + 2 * len(tokens)
    with pytest.raises(DataError, match=rf"^{path}: its bytes are not the ones .*meta.json records \(fingerprint "):
        TokenLoader(prepared, "train", 16, 2, 0, prefetch=False)
    with pytest.raises(DataError, match="its bytes are not the ones"):
        data_identity(prepared)
    TokenLoader(prepared, "val", 16, 2, 0, prefetch=False)  # the val split is intact


def test_a_recorded_shard_that_is_missing_is_refused(prepared):
    (prepared / "text_val_000000.bin").rename(prepared / "elsewhere.bin")
    with pytest.raises(DataError, match=rf"^{prepared / 'text_val_000000.bin'}: recorded in .*, but missing"):
        data_identity(prepared)


def test_the_identity_of_a_recorded_folder_is_its_meta_json_hash_as_before(prepared):
    """Saves made before the shards were covered keep resuming: for a folder whose meta.json records its shards (and
    so covers them, once each is checked), the identity is what it was, the hash of meta.json."""
    assert data_identity(prepared) == hashlib.sha256((prepared / "meta.json").read_bytes()).hexdigest()[:16]


def test_a_folder_without_records_has_its_shards_in_its_identity(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "shards"}))
    identity = data_identity(prepared)
    path = prepared / "text_train_000000.bin"
    write_shard(path, (np.asarray(read_shard(path)) * 7 + 1) % 256)
    assert data_identity(prepared) != identity


def test_resume_onto_a_changed_data_folder_is_refused(prepared, tmp_path):
    """The run-level case: a save, then a shard swapped, then --resume: one line naming the shard, exit 2."""
    out = tmp_path / "run"
    flags = BASE + ["--steps", "2", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "2", "--data",
                    str(prepared), "--out", str(out)]
    quiet(train.main, flags)
    path = prepared / "text_train_000000.bin"
    write_shard(path, (np.asarray(read_shard(path)) * 7 + 1) % 256)
    code, err = exit_of(train.main, flags[:-2] + ["--steps", "3", "--out", str(out), "--resume"])
    assert code == 2 and one_error_line(err).startswith(f"error: {path}: its bytes are not the ones "), err
