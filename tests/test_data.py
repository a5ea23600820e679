"""Tests for varuna_sdk.data: real GPT-2 BPE, real Shakespeare text, deterministic batches."""

from __future__ import annotations

import threading
import time
import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from varuna_sdk.data import (
    BatchLoader,
    ByteTokenizer,
    eval_batches,
    get_tokenizer,
    gpt2_tokenizer,
    load_corpus,
    shakespeare_text,
    tokenize_corpus,
    train_val_split,
)

DATA_DIR = Path(__file__).resolve().parents[1] / "varuna_sdk" / "data"


# ----------------------------------------------------------------------------- tokenizer
def test_gpt2_known_ids_and_round_trip():
    tok = gpt2_tokenizer()
    assert tok is gpt2_tokenizer() is get_tokenizer("gpt2")  # cached
    assert tok.name == "gpt2" and tok.vocab_size == 50257 and tok.eot_token == 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    text = "To be, or not to be: that is the question.\n  Whether 'tis nobler — ünïcödé 123!"
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < 50257 for i in ids)
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # BPE merges, not bytes


def test_gpt2_endoftext_handling():
    tok = gpt2_tokenizer()
    # Default: treated as plain text, never the special id and never an error.
    plain = tok.encode("a<|endoftext|>b")
    assert 50256 not in plain and tok.decode(plain) == "a<|endoftext|>b"
    special = tok.encode("a<|endoftext|>b", allowed_special={"<|endoftext|>"})
    assert special == [64, 50256, 65]
    assert tok.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert tok.decode([50256]) == "<|endoftext|>"


def test_byte_tokenizer():
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.name == "byte" and tok.vocab_size == 256 and tok.eot_token is None
    assert tok.encode("Hi é") == [72, 105, 32, 195, 169]
    assert tok.decode(tok.encode("Hi é")) == "Hi é"
    assert tok.decode([72, 0xFF]) == "H\ufffd"  # invalid utf-8 is replaced, no error
    assert tok.encode_array("Hi").dtype == np.uint16


def test_unknown_tokenizer_lists_names():
    with pytest.raises(ValueError, match=r"gpt2.*byte|byte.*gpt2"):
        get_tokenizer("gpt5")


# ----------------------------------------------------------------------------- corpus
def test_shakespeare_corpus():
    text = shakespeare_text()
    assert len(text.encode("utf-8")) > 4_000_000
    assert "To be, or not to be" in text
    assert "Romeo" in text and "Prospero" in text
    assert load_corpus("shakespeare") is text
    with pytest.raises(ValueError, match="shakespeare"):
        load_corpus("wikipedia")


# ----------------------------------------------------------------------------- tokenize_corpus
def test_tokenize_corpus_gpt2_cache(tmp_path):
    first = tokenize_corpus("shakespeare", "gpt2", cache_dir=tmp_path)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"
    assert "shakespeare" in files[0].name and "gpt2" in files[0].name
    assert first.dtype == np.uint16 and first.ndim == 1
    assert 1_000_000 < len(first) < 2_000_000
    assert int(first.max()) < 50257
    # Same ids as encoding directly.
    tok = gpt2_tokenizer()
    assert first[:200].tolist() == tok.encode(shakespeare_text()[:5000])[:200]

    written = files[0].stat()
    second = tokenize_corpus("shakespeare", "gpt2", cache_dir=tmp_path)
    assert np.array_equal(first, second) and second.dtype == first.dtype
    # read from the cache, not tokenized and written again: the same file, untouched
    now = files[0].stat()
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert sorted(tmp_path.iterdir()) == files  # no temp files left behind


def test_tokenize_corpus_byte_and_corrupt_cache(tmp_path):
    arr = tokenize_corpus("shakespeare", "byte", cache_dir=tmp_path)
    assert arr.dtype == np.uint16
    assert len(arr) == len(shakespeare_text().encode("utf-8"))
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"garbage")  # a corrupt cache is rebuilt, not trusted
    again = tokenize_corpus("shakespeare", "byte", cache_dir=tmp_path)
    assert np.array_equal(arr, again)
    with pytest.raises(ValueError, match="shakespeare"):
        tokenize_corpus("nope", "byte", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="byte"):
        tokenize_corpus("shakespeare", "nope", cache_dir=tmp_path)


def test_train_val_split():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = train_val_split(tokens)
    assert len(val) == 50 and len(train) == 950
    assert np.array_equal(np.concatenate([train, val]), tokens)
    assert val[0] == 950  # held-out part is the tail
    train, val = train_val_split(tokens, val_fraction=0.1)
    assert len(val) == 100
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(tokens, val_fraction=1.0)


# ----------------------------------------------------------------------------- BatchLoader
@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(123).integers(0, 50257, size=20_000).astype(np.uint16)


def test_batch_shapes_and_shift(tokens):
    loader = BatchLoader(tokens, seq_len=32, global_batch=8, seed=5)
    x, y = loader.batch(0)
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Each row is a real window of the token stream.
    for k, o in enumerate(loader.offsets(0).tolist()):
        assert x[k].tolist() == tokens[o : o + 32].tolist()
        assert y[k].tolist() == tokens[o + 1 : o + 33].tolist()


def test_batch_determinism(tokens):
    a = BatchLoader(tokens, seq_len=16, global_batch=4, seed=1)
    b = BatchLoader(tokens.copy(), seq_len=16, global_batch=4, seed=1)
    b.batch(99)  # drawing other steps first changes nothing
    for step in (0, 1, 7, 12345):
        xa, ya = a.batch(step)
        xb, yb = b.batch(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    c = BatchLoader(tokens, seq_len=16, global_batch=4, seed=2)
    assert not torch.equal(a.batch(0)[0], c.batch(0)[0])


@pytest.mark.parametrize("num_replicas", [1, 2, 4])
def test_replica_slices_concatenate(tokens, num_replicas):
    loader = BatchLoader(tokens, seq_len=24, global_batch=8, seed=3)
    for step in (0, 5):
        x, y = loader.batch(step)
        parts = [loader.replica_batch(step, r, num_replicas) for r in range(num_replicas)]
        assert all(p[0].shape == (8 // num_replicas, 24) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_bad_arguments(tokens):
    with pytest.raises(ValueError, match="seq_len"):
        BatchLoader(tokens, seq_len=0, global_batch=4)
    with pytest.raises(ValueError, match="global_batch"):
        BatchLoader(tokens, seq_len=8, global_batch=0)
    with pytest.raises(ValueError, match=r"seq_len \+ 1 = 11.*smaller seq_len \(at most 9\)"):
        BatchLoader(np.arange(10), seq_len=10, global_batch=1)
    BatchLoader(np.arange(11), seq_len=10, global_batch=1).batch(0)  # exactly enough
    with pytest.raises(ValueError, match="1-D"):
        BatchLoader(np.zeros((4, 4), dtype=np.int64), seq_len=2, global_batch=1)
    loader = BatchLoader(tokens, seq_len=8, global_batch=12)
    with pytest.raises(ValueError, match=r"valid num_replicas: \[1, 2, 3, 4, 6, 12\]"):
        loader.replica_batch(0, 0, 5)
    with pytest.raises(ValueError, match="replica"):
        loader.replica_batch(0, 4, 4)
    with pytest.raises(ValueError, match="step"):
        loader.batch(-1)


def test_iteration_and_state_dict_resume(tokens):
    loader = BatchLoader(tokens, seq_len=16, global_batch=4, seed=9)
    assert loader.position == 0
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    assert loader.position == 3
    for step, (x, y) in enumerate(first):
        assert torch.equal(x, loader.batch(step)[0]) and torch.equal(y, loader.batch(step)[1])
    state = loader.state_dict()
    assert state["step"] == 3 and state["seed"] == 9
    expected = [next(loader) for _ in range(4)]

    resumed = BatchLoader(tokens, seq_len=16, global_batch=4, seed=0)
    resumed.load_state_dict(state)
    assert resumed.position == 3 and resumed.seed == 9
    for (xe, ye), (xr, yr) in zip(expected, resumed):
        assert torch.equal(xe, xr) and torch.equal(ye, yr)
    assert resumed.position == 7

    other = BatchLoader(tokens, seq_len=32, global_batch=4)
    with pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict(state)


# ----------------------------------------------------------------------------- eval_batches
def test_eval_batches():
    val = np.arange(1000, dtype=np.uint16)
    batches = eval_batches(val, seq_len=10, batch_size=4, max_batches=None)
    assert len(batches) == 999 // 10 // 4  # 24 full batches
    x0, y0 = batches[0]
    assert x0.shape == (4, 10) and x0.dtype == torch.int64
    assert x0[0].tolist() == list(range(10)) and x0[1].tolist() == list(range(10, 20))
    assert torch.equal(y0, x0 + 1)
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == list(range(0, 960, 10))  # non-overlapping, in order
    again = eval_batches(val, seq_len=10, batch_size=4, max_batches=3)
    assert len(again) == 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, batches))
    with pytest.raises(ValueError, match=r"20 held-out tokens give 1 sequences of seq_len=10, fewer than one batch "
                                         r"of 4 sequences: need at least 41 tokens; use a smaller global batch "
                                         r"\(parallel.global_batch\)"):
        eval_batches(val[:20], seq_len=10, batch_size=4, max_batches=1)


def test_real_pipeline_byte_level(tmp_path):
    tokens = tokenize_corpus("shakespeare", "byte", cache_dir=tmp_path)
    train, val = train_val_split(tokens, 0.05)
    loader = BatchLoader(train, seq_len=64, global_batch=4, seed=0)
    x, _ = loader.batch(0)
    tok = get_tokenizer("byte")
    text = shakespeare_text()
    for row in x:
        assert tok.decode(row.tolist()) in text  # rows are real windows of the corpus
    assert len(eval_batches(val, 64, 4, max_batches=2)) == 2


def test_data_package_does_not_import_runtime_layers():
    forbidden = ("varuna_sdk.pipeline", "varuna_sdk.cluster", "varuna_sdk.manager")
    for path in DATA_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level == 1, (path, node.module)
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith(forbidden), (path, name)


def test_prefetcher_reads_the_next_step_on_one_thread_while_a_step_runs_and_raises_at_its_step():
    """``BatchPrefetcher``: step k + 1 is read on one background thread (always the same, in step
    order) while the caller works on step k; the batches are those ``read`` gives; a read that
    fails raises at the step that needs it, not before; nothing is read past ``stop``; disabled,
    every read is on the caller's thread."""
    import threading

    from varuna_sdk.data.prefetch import BatchPrefetcher

    log: list[tuple[int, str]] = []
    done = {k: threading.Event() for k in range(6)}

    def read(step):
        log.append((step, threading.current_thread().name))
        done[step].set()
        if step == 3:
            raise KeyError("example 12 is gone")
        return {"x": step * 10}

    pf = BatchPrefetcher(read, stop=5)
    got = []
    for step in range(3):
        got.append(pf.get(step))
        # the step's compute: the next batch is read meanwhile, before the caller asks for it
        assert done[step + 1].wait(10), f"step {step + 1} was not read during step {step}"
    assert got == [{"x": 0}, {"x": 10}, {"x": 20}]
    main = threading.current_thread().name                   # the first read: on the caller's thread, checked
    assert log == [(0, main), (1, "varuna-prefetch"), (2, "varuna-prefetch"), (3, "varuna-prefetch")]
    assert pf.off_reason is None
    with pytest.raises(KeyError, match="example 12 is gone"):
        pf.get(3)
    assert pf.get(4) == {"x": 40}
    pf.close()
    assert not done[5].is_set()                             # stop=5: step 5 is never read
    assert pf.get(2) == {"x": 20} and log[-1] == (2, main)  # closed: read on the caller's thread

    log.clear()
    off = BatchPrefetcher(read, stop=5, enabled=False)
    assert off.get(1) == {"x": 10}
    assert log == [(1, main)]


@pytest.mark.parametrize("draw", ["torch", "numpy", "random"])
def test_prefetcher_reads_on_the_main_thread_a_dataset_that_draws_from_a_global_generator(draw):
    """A read that draws from torch's, NumPy's or Python's global generator (a random transform)
    would race with the stages' seeded forwards: prefetching turns itself off after the first read
    and says why; every batch is then read on the caller's thread, in order, and equals reading
    synchronously (the same draws from the same states)."""
    import random
    import threading

    import numpy as np

    from varuna_sdk.data.prefetch import BatchPrefetcher

    threads = []

    def read(step):
        threads.append(threading.current_thread().name)
        if draw == "torch":
            return float(torch.rand(()))
        if draw == "numpy":
            return float(np.random.rand())
        return random.random()

    def reseed():
        torch.manual_seed(3), np.random.seed(3), random.seed(3)

    reseed()
    want = [read(k) for k in range(4)]
    threads.clear()
    reseed()
    pf = BatchPrefetcher(read, stop=4)
    got = [pf.get(k) for k in range(4)]
    pf.close()
    assert got == want and not pf.enabled
    assert threads == [threading.current_thread().name] * 4
    assert {"torch": "torch", "numpy": "NumPy", "random": "Python random"}[draw] in pf.off_reason


@pytest.mark.timeout(60)
@pytest.mark.parametrize("enabled", [True, False])
def test_a_read_that_hangs_is_reported_every_stall_interval_until_it_returns(enabled):
    """A ``__getitem__`` stuck on step 2 (a hung network mount): while ``get(2)`` waits, the
    watchdog reports the step and the seconds waited every ``stall_s`` (read ahead or on the
    caller's thread alike); once the read returns the reports stop, and quick reads never report."""
    from varuna_sdk.data.prefetch import BatchPrefetcher

    release = threading.Event()
    stalls: list[tuple[int, float]] = []

    def read(step: int) -> int:
        if step == 2:
            release.wait(30)
        return step * 10

    pf = BatchPrefetcher(read, 5, enabled=enabled, on_stall=lambda s, w: stalls.append((s, w)), stall_s=0.3)
    try:
        assert [pf.get(0), pf.get(1)] == [0, 10] and stalls == []
        threading.Timer(1.1, release.set).start()
        assert pf.get(2) == 20
        seen = list(stalls)
        assert [s for s, _ in seen] == [2] * len(seen) and 2 <= len(seen) <= 4, seen
        assert all(w >= 0.3 * (k + 1) - 0.05 for k, (_, w) in enumerate(seen)), seen
        assert [pf.get(3), pf.get(4)] == [30, 40]
        time.sleep(0.7)
        assert stalls == seen
    finally:
        pf.close()
