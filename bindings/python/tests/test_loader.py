"""The Python package against the files it reads: every column type, each sample once
per epoch, exact resume, errors, views that keep their buffers, DLPack, tokens, the
report."""

import gc
import json
import os
import pickle
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stokehold

N = 1000
DTYPES = [
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.bool_,
]
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cols(tmp_path_factory):
    """A directory of columns: x (N, 3, 4, 4) uint8, y (N,) int64, and one (N, 2) column
    of every other dtype, each row derived from its index."""
    d = tmp_path_factory.mktemp("cols")
    i = np.arange(N)
    np.save(d / "x.npy", (i[:, None] * 7 + np.arange(48)[None, :]).astype(np.uint8).reshape(N, 3, 4, 4))
    np.save(d / "y.npy", (i * 3 % 10).astype(np.int64))
    for t in DTYPES:
        name = np.dtype(t).name
        v = np.stack([i, i + 1], axis=1)
        np.save(d / f"c_{name}.npy", (v % 2 == 0) if t is np.bool_ else (v % 100).astype(t))
    return d


def expected(d, name):
    return np.load(d / f"{name}.npy")


def all_indices(loader, epoch):
    return np.concatenate([b.indices.copy() for b in loader.epoch(epoch)])


def test_every_column_and_dtype_equals_the_files(cols):
    loader = stokehold.Loader(cols, batch_size=64, shuffle="full", seed=1, workers=2)
    names = ["x", "y"] + sorted(f"c_{np.dtype(t).name}" for t in DTYPES)
    assert list(loader.columns) == names
    files = {n: expected(cols, n) for n in names}
    seen = 0
    for batch in loader.epoch(0):
        idx = batch.indices
        assert idx.dtype == np.uint64
        for n in names:
            a = batch[n]
            assert a.dtype == files[n].dtype, n
            assert a.shape == (len(batch),) + files[n].shape[1:], n
            np.testing.assert_array_equal(a, files[n][idx])
        seen += len(batch)
    assert seen == N
    assert len(loader) == (N + 63) // 64


def test_each_sample_once_per_epoch_and_epochs_differ(cols):
    loader = stokehold.Loader(cols, batch_size=37, seed=5, workers=2)
    e0, e1 = all_indices(loader, 0), all_indices(loader, 1)
    assert sorted(e0.tolist()) == list(range(N))
    assert sorted(e1.tolist()) == list(range(N))
    assert not np.array_equal(e0, e1)
    np.testing.assert_array_equal(e0, all_indices(loader, 0))


def test_order_does_not_depend_on_workers(cols):
    a = all_indices(stokehold.Loader(cols, batch_size=50, seed=2, workers=1), 3)
    b = all_indices(stokehold.Loader(cols, batch_size=50, seed=2, workers=4), 3)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shuffle", ["full", "block", "none"])
def test_shuffles_and_drop_last(cols, shuffle):
    loader = stokehold.Loader(cols, batch_size=300, shuffle=shuffle, drop_last=True)
    sizes = [len(b) for b in loader.epoch(0)]
    assert sizes == [300, 300, 300]
    if shuffle == "none":
        np.testing.assert_array_equal(all_indices(loader, 0), np.arange(900))


@pytest.mark.parametrize("shuffle", ["full", "block"])
def test_streamed_batches_are_the_same_with_or_without_direct_reads(cols, shuffle):
    def loader(direct):
        return stokehold.Loader(
            cols, batch_size=64, shuffle=shuffle, seed=4, page_cache_budget=0, direct_reads=direct
        )

    direct, cached = loader(True), loader(False)
    assert cached.info()["direct_reads"] is False
    if direct.info()["direct_reads"] is not True:
        # Where the file system refuses O_DIRECT; CI's disk must not.
        assert os.environ.get("STOKEHOLD_REQUIRE_COLD") != "1", "direct reads are off here"
        pytest.skip("this file system takes no direct reads")
    n = 0
    for a, b in zip(direct.epoch(1), cached.epoch(1)):
        for name in ("x", "y"):
            np.testing.assert_array_equal(a[name], b[name])
        n += len(a)
    assert n == N


def test_iterating_the_loader_walks_the_epochs_in_turn(cols):
    # `for batch in loader` in a loop over epochs (a framework calling iter(loader)
    # each epoch): epoch 0, 1, ...; an epoch left early is not begun again; a loaded
    # state's epoch resumes; set_epoch picks the next one.
    loader = stokehold.Loader(cols, batch_size=64, seed=3)
    want = [all_indices(stokehold.Loader(cols, batch_size=64, seed=3), e) for e in range(4)]
    # An iterator made and dropped unused (Lightning checks that a loader is iterable so)
    # starts no epoch.
    iter(loader)
    got = [np.concatenate([b.indices.copy() for b in loader]) for _ in range(2)]
    assert all((g == w).all() for g, w in zip(got, want[:2])) and len(got) == 2
    it = iter(loader)
    assert next(it).epoch == 2
    state = loader.state_dict()
    del it
    # Epoch 2 was left after one batch: the next epoch is 3, not 2 again.
    assert (np.concatenate([b.indices.copy() for b in loader]) == want[3]).all()
    # Resumed after epoch 2's first batch: its rest, then epoch 3.
    loader.load_state_dict(state)
    rest = np.concatenate([b.indices.copy() for b in loader])
    assert (rest == want[2][64:]).all()
    assert [b.epoch for b in loader][0] == 3
    loader.set_epoch(1)
    assert (np.concatenate([b.indices.copy() for b in loader]) == want[1]).all()
    with pytest.raises(ValueError, match="-1"):
        loader.set_epoch(-1)


def test_resume_exactly_through_json(cols):
    whole = all_indices(stokehold.Loader(cols, batch_size=40, seed=9), 2)
    loader = stokehold.Loader(cols, batch_size=40, seed=9)
    it = loader.epoch(2)
    head = [next(it).indices.copy() for _ in range(7)]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 2 and state["batch"] == 7
    assert it.state_dict() == state
    del it
    restarted = stokehold.Loader(cols, batch_size=40, seed=9)
    restarted.load_state_dict(state)
    rest = all_indices(restarted, 2)
    np.testing.assert_array_equal(np.concatenate(head + [rest]), whole)
    # The next epoch is whole again.
    assert len(all_indices(restarted, 3)) == N


def test_a_state_from_another_configuration_raises(cols):
    loader = stokehold.Loader(cols, batch_size=40, seed=9)
    state = loader.state_dict()
    other = stokehold.Loader(cols, batch_size=40, seed=10)
    with pytest.raises(stokehold.Error, match="another order"):
        other.load_state_dict(state)
    with pytest.raises(stokehold.Error, match="integers only"):
        other.load_state_dict(dict(state, epoch="zero"))
    with pytest.raises(stokehold.Error, match="needs its 'order' key"):
        other.load_state_dict({"epoch": 0, "batch": 0})
    with pytest.raises(TypeError, match="is a dict, not list"):
        other.load_state_dict([1, 2])
    # A misspelt or missing key would turn the check off: refused.
    ordr = {("ordr" if k == "order" else k): v for k, v in state.items()}
    with pytest.raises(stokehold.Error, match="'order'"):
        other.load_state_dict(ordr)
    with pytest.raises(stokehold.Error, match="ordr"):
        other.load_state_dict(dict(ordr, order=state["order"]))
    other.load_state_dict(dict(state, order=0))  # the explicit way to skip the check


def test_a_refused_state_leaves_the_running_epoch_and_numpy_integers_resume(cols):
    whole = all_indices(stokehold.Loader(cols, batch_size=40, seed=9), 0)
    loader = stokehold.Loader(cols, batch_size=40, seed=9)
    it = loader.epoch(0)
    next(it)
    other = stokehold.Loader(cols, batch_size=40, seed=10).state_dict()
    with pytest.raises(stokehold.Error, match="another order"):
        loader.load_state_dict(other)
    next(it)  # the epoch runs on: the refused state changed nothing
    # Restored through numpy (np.savez, a tensor's values): the same integers.
    state = {k: np.uint64(v) for k, v in loader.state_dict().items()}
    with pytest.raises(stokehold.Error, match="integers"):
        loader.load_state_dict(dict(state, batch=2.0))
    del it
    resumed = stokehold.Loader(cols, batch_size=40, seed=9)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(all_indices(resumed, 0), whole[80:])


def test_errors_pickle():
    e = pickle.loads(pickle.dumps(stokehold.Error("x.npy: not a .npy file")))
    assert type(e) is stokehold.Error and str(e) == "x.npy: not a .npy file"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_gets_an_error_not_a_hang(cols):
    loader = stokehold.Loader(cols, batch_size=100)
    it = loader.epoch(0)
    next(it)
    pid = os.fork()
    if pid == 0:
        code = 9
        try:
            code = 0
            for call in (lambda: loader.epoch(1), lambda: next(it)):
                try:
                    call()
                    code = 1
                except stokehold.Error as e:
                    code = code if "forked child" in str(e) else 2
            del it, loader
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert sum(len(b) for b in loader.epoch(1)) == N  # the parent's loader is fine


def test_a_state_over_the_same_file_read_otherwise_raises(tmp_path):
    # The same file, the same length and shuffle: other random windows.
    raw = tmp_path / "t.bin"
    np.arange(20_000, dtype=np.uint16).tofile(raw)
    tl = lambda seed: stokehold.TokenLoader(raw, seq_len=64, batch_size=8, shuffle="none",
                                            windows="random", seed=seed)
    saved = tl(1)
    it = saved.epoch(0)
    next(it)
    state = saved.state_dict()
    del it
    tl(1).load_state_dict(state)
    with pytest.raises(stokehold.Error, match="another order"):
        tl(2).load_state_dict(state)


def test_a_resumed_epoch_ended_before_its_first_batch_leaves_the_resume(cols):
    whole = all_indices(stokehold.Loader(cols, batch_size=40, seed=9), 1)
    loader = stokehold.Loader(cols, batch_size=40, seed=9)
    it = loader.epoch(1)
    head = [next(it).indices.copy() for _ in range(3)]
    state = loader.state_dict()
    del it
    loader.load_state_dict(state)
    loader.epoch(1)
    # info() reads the loader as built, leaving the epoch alone; another epoch(1) ends
    # it before it gave a batch.
    assert loader.info()["buffers"] > 0
    loader.epoch(1)
    assert loader.state_dict() == state
    rest = all_indices(loader, 1)
    np.testing.assert_array_equal(np.concatenate(head + [rest]), whole)


def test_an_elastic_resume_goes_on_with_another_world_size(cols):
    # Two ranks of batch 40 take 5 batches each; the job restarts on three ranks of 32.
    old = [stokehold.Loader(cols, batch_size=40, seed=9, rank=r, world_size=2) for r in range(2)]
    taken = []
    for loader in old:
        it = loader.epoch(1)
        taken += [next(it).indices.copy() for _ in range(5)]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
    assert state["taken"] == 400 and state["start"] == 0
    rest = []
    for r in range(3):
        new = stokehold.Loader(cols, batch_size=32, seed=9, rank=r, world_size=3)
        with pytest.raises(stokehold.Error, match="another order"):
            new.load_state_dict(state)
        new.load_state_dict(state, elastic=True)
        rest.append(all_indices(new, 1))
        assert new.state_dict()["epoch"] == 2
    # 600 samples left over 3 ranks: 200 each, every one once, none taken before.
    assert [len(r) for r in rest] == [200, 200, 200]
    everything = np.concatenate(taken + rest)
    np.testing.assert_array_equal(np.sort(everything), np.arange(N))
    other = stokehold.Loader(cols, batch_size=32, seed=10)
    with pytest.raises(stokehold.Error, match="another global order"):
        other.load_state_dict(state, elastic=True)


def test_bad_input_raises_naming_the_file(tmp_path):
    assert issubclass(stokehold.Error, Exception)
    with pytest.raises(stokehold.Error, match="nowhere"):
        stokehold.Loader(tmp_path / "nowhere")
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    with pytest.raises(stokehold.Error, match="x.npy"):
        stokehold.Loader(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(stokehold.Error, match="empty"):
        stokehold.Loader(empty)
    d = tmp_path / "mismatch"
    d.mkdir()
    np.save(d / "x.npy", np.zeros((10, 2), np.float32))
    np.save(d / "y.npy", np.zeros(11, np.int64))
    with pytest.raises(stokehold.Error, match="y.npy: has 11 rows"):
        stokehold.Loader(d)
    np.save(d / "y.npy", np.zeros(10, np.int64))
    with pytest.raises(ValueError, match="shuffle"):
        stokehold.Loader(d, shuffle="sideways")
    with pytest.raises(ValueError, match="rank"):
        stokehold.Loader(d, rank=0)
    with pytest.raises(ValueError, match="windows"):
        stokehold.TokenLoader(d / "x.npy", seq_len=2, windows="sometimes")
    with pytest.raises(stokehold.Error, match="batch"):
        stokehold.Loader(d, batch_size=0)
    # Counts, sizes, seeds and epochs out of range raise naming the argument (not an
    # OverflowError naming nothing); a float or a string is a TypeError.
    for kw in ({"batch_size": -1}, {"seed": -1}, {"workers": -1}, {"prefetch": -2},
               {"held": -1}, {"page_cache_budget": -1}, {"seed": 2**64}):
        with pytest.raises(ValueError, match=list(kw)[0]):
            stokehold.Loader(d, **kw)
    with pytest.raises(TypeError, match="batch_size"):
        stokehold.Loader(d, batch_size=2.5)
    with pytest.raises(ValueError, match="seq_len"):
        stokehold.TokenLoader(d / "x.npy", seq_len=-1)
    loader = stokehold.Loader(d, batch_size=5)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="epoch"):
            loader.epoch(bad)
        with pytest.raises(ValueError, match="epoch"):
            loader.set_epoch(bad)
    # The largest epoch runs; the one after it cannot be asked for.
    assert sum(len(b) for b in loader.epoch(2**64 - 1)) == 10
    with pytest.raises(ValueError, match="epoch"):
        next(iter(loader))


def test_views_keep_their_buffer_and_the_pool_refills(cols):
    loader = stokehold.Loader(cols, batch_size=100, workers=2, prefetch=2, held=2, seed=0)
    x_file = expected(cols, "x")
    it = loader.epoch(0)
    batch = next(it)
    x, idx = batch["x"], batch.indices.copy()
    assert x.flags.writeable and not batch.indices.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        batch.indices[0] = 7
    del batch
    # The view alone holds the buffer: other batches do not overwrite it.
    others = [next(it) for _ in range(2)]
    del others
    for _ in it:
        pass
    np.testing.assert_array_equal(x, x_file[idx])
    del x
    gc.collect()
    # Every buffer is back: another epoch runs whole.
    assert len(all_indices(loader, 1)) == N


def test_a_loop_that_keeps_batches_sizes_held(cols):
    loader = stokehold.Loader(cols, batch_size=50, workers=2, prefetch=2, held=8)
    kept, n = [], 0
    for batch in loader.epoch(0):
        n += 1
        kept.append(batch)
        if len(kept) > 8:
            kept.pop(0)
    # The epoch ran whole with 8 batches alive at every step past the eighth.
    assert n == len(loader) > 8


def test_batches_consumed_on_another_thread(cols):
    loader = stokehold.Loader(cols, batch_size=50, workers=2, prefetch=2)
    q = queue.Queue(maxsize=2)
    got, wrong = [], []

    y = expected(cols, "y")

    def consume():
        while (b := q.get()) is not None:
            # Still the batch's own rows: its buffer was not reused while it queued.
            if not np.array_equal(b["y"], y[b.indices]):
                wrong.append(b.indices.copy())
            got.append(len(b))

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    for batch in loader.epoch(0):
        q.put(batch, timeout=30)
    q.put(None, timeout=30)
    t.join(30)
    assert not wrong, wrong
    assert got == [50] * 20


def test_a_thread_waiting_for_a_buffer_blocks_neither_state_dict_nor_a_new_epoch(cols):
    # A loading thread puts batches in a queue this thread reads, and waits for a buffer
    # that the queued batches keep: a checkpoint or the epoch's figures taken here must
    # not wait for it.
    loader = stokehold.Loader(cols, batch_size=50, workers=2, prefetch=2, held=2)
    q, ended = queue.Queue(), []
    running = loader.epoch(0)

    def load():
        try:
            for b in running:
                q.put(b)
        except stokehold.Error as e:
            ended.append(str(e))

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    first = q.get(timeout=10)
    assert first["x"].shape[0] == 50  # read here: held away from the loading thread
    deadline = time.monotonic() + 10
    while q.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert q.qsize() == 3  # every buffer is held (4), and the loading thread waits

    def within(seconds, call):
        out = []
        t = threading.Thread(target=lambda: out.append(call()), daemon=True)
        t.start()
        t.join(seconds)
        assert out, f"{call} did not return within {seconds} s"
        return out[0]

    state = within(5, loader.state_dict)
    assert (state["epoch"], state["batch"]) == (0, 4)
    stats = within(5, running.stats)
    assert (stats["batches"], stats["samples"]) == (4, 200)
    # A new epoch ends the old one, waking the loading thread with an error.
    epoch = within(5, lambda: loader.epoch(1))
    loading.join(5)
    assert not loading.is_alive()
    assert len(ended) == 1 and "this epoch was ended" in ended[0]
    with pytest.raises(stokehold.Error, match="this epoch was ended"):
        running.stats()
    del first
    while not q.empty():
        q.get()
    assert sum(len(b) for b in epoch) == N


def waiting_for_ever(cols):
    """A loader, its epoch 0 after two batches, and those batches read and kept on
    another thread until the returned event is set: the loop's wait for a third is no
    deadlock the loader could call (that thread may let go), so it lasts as long as the
    thread keeps them. Returns (loader, epoch, release, keeper)."""
    loader = stokehold.Loader(cols, batch_size=50, workers=1, prefetch=1, held=1)
    it = loader.epoch(0)
    kept = [next(it), next(it)]
    release = threading.Event()

    def keep():
        assert all(b["x"].shape[0] == 50 for b in kept)  # read here: held away
        release.wait(10)
        kept.clear()

    keeper = threading.Thread(target=keep, daemon=True)
    keeper.start()
    time.sleep(0.2)
    return loader, it, release, keeper


def test_ctrl_c_stops_a_wait_that_would_not_end(cols):
    import signal

    loader, it, release, keeper = waiting_for_ever(cols)
    # Python's own handler, whatever the parent left (a background job ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            next(it)
    finally:
        signal.signal(signal.SIGINT, previous)
    release.set()
    keeper.join(10)
    # Nothing was lost: the batch the wait was for comes next.
    assert loader.state_dict()["batch"] == 2
    want = [b.indices.copy() for b in stokehold.Loader(cols, batch_size=50).epoch(0)]
    np.testing.assert_array_equal(next(it).indices, want[2])


def test_a_signal_handler_may_use_the_loader_while_the_loop_waits(cols):
    # The handler runs with the epoch's lock let go: a handler that saves a checkpoint
    # or asks the loader anything (here `info()`, then a resume, which ends the running
    # epoch) neither deadlocks nor is lost.
    import signal

    loader, it, release, keeper = waiting_for_ever(cols)
    seen = []

    def handler(signum, frame):
        seen.append((loader.state_dict()["batch"], loader.info()["buffers"]))
        loader.load_state_dict(loader.state_dict())

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(stokehold.Error, match="ended"):
            next(it)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        release.set()
        keeper.join(10)
    assert seen == [(2, 2)]


def test_calls_from_other_threads_wait_their_turn(cols):
    # A checkpointing thread asks for the state and the length while epochs start: it
    # waits for each start instead of failing with pyo3's "Already borrowed".
    loader = stokehold.Loader(cols, batch_size=100, workers=2)
    errors, stop = [], threading.Event()

    def checkpoint():
        while not stop.is_set():
            try:
                loader.state_dict()
                len(loader)
            except Exception as e:  # noqa: BLE001: any failure is the finding
                errors.append(repr(e))
                return

    t = threading.Thread(target=checkpoint)
    t.start()
    try:
        for e in range(30):
            assert sum(len(b) for b in loader.epoch(e)) == N
    finally:
        stop.set()
        t.join()
    assert not errors, errors[0]


def test_the_gil_is_released_while_waiting(cols):
    # The loop waits for a buffer that another thread keeps until a timer lets it go:
    # a counting thread must run all along, and the timer must fire (were the GIL held
    # through the wait, the child would hang until its timeout).
    script = textwrap.dedent("""
        import sys, threading, time
        import stokehold

        loader = stokehold.Loader(sys.argv[1], batch_size=50, workers=1, prefetch=1, held=1)
        it = loader.epoch(0)
        kept = [next(it), next(it)]
        release, stop, ticks = threading.Event(), threading.Event(), [0]

        def keep():
            assert all(b["x"].shape[0] == 50 for b in kept)  # read here: held away
            release.wait(20)
            kept.clear()

        def count():
            while not stop.is_set():
                ticks[0] += 1

        threading.Thread(target=keep, daemon=True).start()
        time.sleep(0.2)
        counter = threading.Thread(target=count, daemon=True)
        counter.start()
        threading.Timer(0.5, release.set).start()
        before, started = ticks[0], time.monotonic()
        third = next(it)
        waited, counted = time.monotonic() - started, ticks[0] - before
        stop.set()
        assert len(third) == 50 and waited >= 0.4, waited
        assert counted > 10_000, counted
        print("child passed")
    """)
    out = subprocess.run([sys.executable, "-c", script, str(cols)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "child passed" in out.stdout, out.stdout + out.stderr


def test_an_epoch_ended_by_an_error_says_so_again_and_goes_on_where_it_stopped(cols):
    loader = stokehold.Loader(cols, batch_size=50, workers=1, prefetch=1, held=1, seed=4)
    want = [b.indices.copy() for b in stokehold.Loader(cols, batch_size=50, seed=4).epoch(0)]
    it = loader.epoch(0)
    kept = [next(it), next(it)]
    # Every buffer is held here: an error, not a hang; it ends the epoch.
    with pytest.raises(stokehold.Error, match="buffers are held"):
        next(it)
    # A loop that caught it and goes on gets it again, never a short epoch's end.
    for _ in range(2):
        with pytest.raises(stokehold.Error, match="epoch 0 ended with an error at batch 2"):
            next(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batch"]) == (0, 2)
    del kept
    rest = [b.indices.copy() for b in loader.epoch(0)]
    assert len(rest) == len(want) - 2
    assert all(np.array_equal(a, b) for a, b in zip(rest, want[2:]))


def test_for_batch_in_loader_goes_on_with_an_epoch_an_error_ended(cols):
    # Iterating the loader itself: after an error (or Ctrl-C) while a batch is awaited,
    # the next `for batch in loader` goes on with that epoch, from that batch; a break
    # leaves the epoch, as before.
    loader = stokehold.Loader(cols, batch_size=50, workers=1, prefetch=1, held=1, seed=4)
    want = [b.indices.copy() for b in stokehold.Loader(cols, batch_size=50, seed=4).epoch(0)]
    kept = []
    with pytest.raises(stokehold.Error, match="buffers are held"):
        for batch in loader:
            kept.append(batch)
    n = len(kept)
    del kept, batch
    rest = [b.indices.copy() for b in loader]
    assert len(rest) == len(want) - n
    assert all(np.array_equal(a, b) for a, b in zip(rest, want[n:]))
    for batch in loader:  # epoch 1, left at once
        break
    del batch
    assert next(iter(loader)).epoch == 2


def test_loaders_epochs_and_batches_refuse_to_be_pickled_or_copied(cols):
    import copy
    import pickle

    loader = stokehold.Loader(cols, batch_size=50)
    it = loader.epoch(0)
    batch = next(it)
    for thing in (loader, it, batch):
        for share in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match="cannot be pickled"):
                share(thing)
    # A batch's arrays copied are plain NumPy arrays, which pickle.
    sent = pickle.loads(pickle.dumps({k: np.array(v) for k, v in batch.items()}))
    np.testing.assert_array_equal(sent["x"], batch["x"])


def test_a_closed_loader_frees_its_threads_and_refuses_use(cols):
    with stokehold.Loader(cols, batch_size=50) as loader:
        kept = next(iter(loader))
    # The batch held keeps its own buffer.
    assert kept["x"].shape[0] == 50
    with pytest.raises(stokehold.Error, match="closed"):
        loader.epoch(0)
    with pytest.raises(stokehold.Error, match="closed"):
        len(loader)


def test_arguments_after_batch_size_are_keywords_and_types_resolve(cols):
    import typing

    with pytest.raises(TypeError):
        stokehold.Loader(cols, 50, "none")
    for cls in (stokehold.Loader, stokehold.TokenLoader, stokehold.DocumentLoader,
                stokehold.PackedLoader, stokehold.MixLoader):
        hints = typing.get_type_hints(cls.__init__)  # names resolve (PathLike's os)
        assert "batch_size" in hints
    # A device named as an int or an object whose str is the name.
    assert stokehold._device(1) == "cuda:1"
    assert stokehold._device("cpu") == "cpu"
    with pytest.raises(TypeError, match="device is"):
        stokehold._device(1.5)


def test_starting_an_epoch_ends_the_last(cols):
    loader = stokehold.Loader(cols, batch_size=100)
    old = loader.epoch(0)
    next(old)
    new = loader.epoch(1)
    with pytest.raises(stokehold.Error, match="ended"):
        next(old)
    assert sum(len(b) for b in new) == N
    # An epoch that ran to its end stays ended, whatever the loader does next.
    loader.epoch(2)
    assert next(new, None) is None


def test_sharding_splits_the_samples(cols):
    parts = [all_indices(stokehold.Loader(cols, batch_size=32, rank=r, world_size=3), 0) for r in range(3)]
    joined = np.concatenate(parts)
    # Every sample, each rank ceil(N / 3) of them: the two padding the tail are the only
    # repeats (as DistributedSampler pads), so no rank reads another's share.
    assert [len(p) for p in parts] == [-(-N // 3)] * 3
    np.testing.assert_array_equal(np.unique(joined), np.arange(N))
    assert all(len(p) > 0 for p in parts)


def test_rank_from_the_environment(cols, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    mine = all_indices(stokehold.Loader(cols, batch_size=32), 0)
    explicit = all_indices(stokehold.Loader(cols, batch_size=32, rank=1, world_size=2), 0)
    np.testing.assert_array_equal(mine, explicit)


def test_torch_from_dlpack_shares_memory(cols):
    torch = pytest.importorskip("torch")
    loader = stokehold.Loader(cols, batch_size=100)
    batch = next(loader.epoch(0))
    x = batch["x"]
    t = torch.from_dlpack(x)
    assert t.shape == x.shape and t.dtype == torch.uint8
    assert t.data_ptr() == x.__array_interface__["data"][0]
    y = torch.from_dlpack(batch["y"])
    assert y.dtype == torch.int64
    np.testing.assert_array_equal(y.numpy(), batch["y"])


def test_jax_from_dlpack_shares_memory(cols):
    jax = pytest.importorskip("jax")
    # Without x64, JAX turns int64 into int32, which is a copy; with it, none is.
    jax.config.update("jax_enable_x64", True)
    loader = stokehold.Loader(cols, batch_size=100)
    batch = next(loader.epoch(0))
    for name in ("x", "y", "c_float32"):
        a = batch[name]
        j = jax.dlpack.from_dlpack(a)
        assert j.shape == a.shape and j.dtype == a.dtype, name
        assert j.unsafe_buffer_pointer() == a.__array_interface__["data"][0], name
        np.testing.assert_array_equal(np.asarray(j), a)


def test_numpy_from_dlpack_shares_memory(cols):
    loader = stokehold.Loader(cols, batch_size=100)
    batch = next(loader.epoch(0))
    x = batch["c_float32"]
    y = np.from_dlpack(x)
    assert y.__array_interface__["data"][0] == x.__array_interface__["data"][0]


def test_token_loader(tmp_path):
    tokens = (np.arange(20_000) % 50_000).astype(np.uint16)
    raw = tmp_path / "train.bin"
    tokens.tofile(raw)
    loader = stokehold.TokenLoader(raw, seq_len=64, batch_size=8, windows="consecutive", shuffle="none")
    assert list(loader.columns) == ["tokens"]
    first = next(loader.epoch(0))["tokens"]
    assert first.shape == (8, 65) and first.dtype == np.uint16
    np.testing.assert_array_equal(first[1], tokens[64:129])
    rnd = stokehold.TokenLoader(raw, seq_len=64, batch_size=8, windows="random", seed=3)
    for b in rnd.epoch(0):
        t = b["tokens"]
        # Each window is a run of consecutive tokens of the stream.
        assert np.all(np.diff(t.astype(np.int64), axis=1) == 1)
    npy = tmp_path / "tokens.npy"
    np.save(npy, tokens.astype(np.uint32))
    n = stokehold.TokenLoader(npy, seq_len=64, batch_size=8, windows="consecutive", shuffle="none")
    np.testing.assert_array_equal(next(n.epoch(0))["tokens"][0], tokens[:65])
    with pytest.raises(stokehold.Error, match="train.bin"):
        stokehold.TokenLoader(raw, seq_len=100_000)
    with pytest.raises(ValueError, match="dtype 'int64'|dtype \"int64\""):
        stokehold.TokenLoader(raw, seq_len=8, dtype="int64")
    with pytest.raises(stokehold.Error, match="dtype uint16 was asked for, and .*tokens.npy holds uint32"):
        stokehold.TokenLoader(npy, seq_len=8, dtype="uint16")
    # A .npy of signed tokens, named by its own type.
    np.save(npy, tokens.astype(np.int32))
    signed = stokehold.TokenLoader(npy, seq_len=8, dtype="int32", windows="consecutive",
                                   shuffle="none")
    assert signed.columns["tokens"] == (np.dtype(np.int32), (9,))
    with pytest.raises(ValueError, match="integer tokens"):
        stokehold.TokenLoader(npy, seq_len=8, dtype="float32")
    # An llm.c file gives its own token type: uint32 (LLaMA-3, version 7) here.
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240801, 7, len(tokens))
    llmc = tmp_path / "llama.bin"
    llmc.write_bytes(header.tobytes() + tokens.astype(np.uint32).tobytes())
    l3 = stokehold.TokenLoader(llmc, seq_len=64, batch_size=8, windows="consecutive", shuffle="none")
    first = next(l3.epoch(0))["tokens"]
    assert first.dtype == np.uint32
    np.testing.assert_array_equal(first[0], tokens[:65])
    with pytest.raises(stokehold.Error, match="llm.c header says uint32 tokens, uint16 were asked"):
        stokehold.TokenLoader(llmc, seq_len=64, dtype="uint16")


def test_token_loader_reads_litdata_chunks():
    # As litgpt prepares pretraining data (tests/fixtures/make_litdata.py): items of 5,
    # 12, 3, 40 and 1 tokens (token j of item k is 100 k + j) in chunks of 20, 40 and 1.
    root = REPO / "tests" / "fixtures" / "litdata"
    items = [100 * k + np.arange(n) for k, n in enumerate([5, 12, 3, 40, 1])]
    loader = stokehold.TokenLoader(root / "litdata_u16", seq_len=7, batch_size=16,
                                   windows="consecutive", shuffle="none")
    assert loader.columns["tokens"] == (np.dtype(np.uint16), (8,))
    b = next(loader.epoch(0))
    chunk0 = np.concatenate(items[:3])
    want = [chunk0[7 * i:7 * i + 8] for i in range(2)] + [items[3][7 * i:7 * i + 8] for i in range(5)]
    np.testing.assert_array_equal(b["tokens"], np.stack(want))
    i32 = stokehold.TokenLoader(root / "litdata_i32" / "index.json", seq_len=60, batch_size=4,
                                dtype="int32", shuffle="none")
    np.testing.assert_array_equal(next(i32.epoch(0))["tokens"], [np.concatenate(items)])
    with pytest.raises(stokehold.Error, match="dtype uint16 was asked for.*holds int32"):
        stokehold.TokenLoader(root / "litdata_i32", seq_len=60, dtype="uint16")
    with pytest.raises(stokehold.Error, match="index.json.*optimized for the PyTreeLoader"):
        stokehold.TokenLoader(root / "litdata_items", seq_len=4)



FIXTURES = REPO / "tests" / "fixtures" / "npy"
# The fixtures' documents (tests/fixtures/make_npy.py): token j of document i is 100 i + j.
DOCS = [[100 * i + j for j in range(n)] for i, n in enumerate([5, 0, 12, 3, 40, 1])]


def padded(doc, max_len, pad):
    row = doc[:max_len]
    return row + [pad] * (max_len - len(row)), len(row)


def test_document_loader_reads_megatron_and_offsets_in_place():
    mega = stokehold.DocumentLoader(FIXTURES / "megatron_u16", max_len=16, batch_size=4,
                                    pad=7, shuffle="none")
    assert mega.columns == {"tokens": (np.dtype(np.uint16), (16,)), "len": (np.dtype(np.int64), ())}
    rows = [(list(t), int(n)) for b in mega.epoch(0) for t, n in zip(b["tokens"], b["len"])]
    assert rows == [padded(d, 16, 7) for d in DOCS]
    npy = stokehold.DocumentLoader(FIXTURES / "docs_tokens.npy", max_len=8, batch_size=4,
                                   offsets=FIXTURES / "docs_offsets.npy", pad=-1, shuffle="none")
    batch = next(npy.epoch(0))
    assert batch["tokens"].dtype == np.int32 and batch["tokens"].shape == (4, 8)
    rows = [(list(t), int(n)) for t, n in zip(batch["tokens"], batch["len"])]
    assert rows == [padded(d, 8, -1) for d in DOCS[:4]]
    with pytest.raises(stokehold.Error, match="megatron_bad_pointer.idx.*lies outside"):
        stokehold.DocumentLoader(FIXTURES / "megatron_bad_pointer", max_len=16)
    with pytest.raises(stokehold.Error, match="docs_bad_falling.npy.*offset 2 is 4"):
        stokehold.DocumentLoader(FIXTURES / "docs_tokens.npy", max_len=16,
                                 offsets=FIXTURES / "docs_bad_falling.npy")
    with pytest.raises(stokehold.Error, match="pad -1 does not fit"):
        stokehold.DocumentLoader(FIXTURES / "megatron_u16", max_len=16, pad=-1)
    # A group of 0 would silently be the default one.
    with pytest.raises(ValueError, match="group=0"):
        stokehold.DocumentLoader(FIXTURES / "megatron_u16", max_len=16, shuffle="grouped",
                                 group=0)
    with pytest.raises(ValueError, match="max_len"):
        stokehold.DocumentLoader(FIXTURES / "megatron_u16", max_len=-16)


def test_packed_loader_concatenates_documents_with_positions():
    # The fixtures' documents: 5, 0, 12, 3, 40 and 1 tokens, token j of document i = 100 i + j.
    lens = [5, 0, 12, 3, 40, 1]
    stream = np.concatenate([100 * i + np.arange(n) for i, n in enumerate(lens)])
    positions = np.concatenate([np.arange(n) for n in lens])
    for path, kw in [(FIXTURES / "megatron_u16", {}),
                     (FIXTURES / "docs_tokens.npy", {"offsets": FIXTURES / "docs_offsets.npy"})]:
        loader = stokehold.PackedLoader(path, seq_len=7, batch_size=3, windows="consecutive",
                                        shuffle="none", **kw)
        assert len(loader) == 3  # 8 windows of 8 tokens from 61
        assert loader.columns["positions"] == (np.dtype(np.int32), (8,))
        rows = [(int(i), t, p) for b in loader.epoch(0)
                for i, t, p in zip(b.indices, b["tokens"], b["positions"])]
        assert [r[0] for r in rows] == list(range(8))
        for i, t, p in rows:
            np.testing.assert_array_equal(t, stream[7 * i:7 * i + 8])
            np.testing.assert_array_equal(p, positions[7 * i:7 * i + 8])
    with pytest.raises(stokehold.Error, match="megatron_u16.bin.*fewer than one window"):
        stokehold.PackedLoader(FIXTURES / "megatron_u16", seq_len=61)
    with pytest.raises(ValueError, match="windows"):
        stokehold.PackedLoader(FIXTURES / "megatron_u16", seq_len=7, windows="shifted")
    # What a varlen attention kernel takes, derived from the positions alone.
    first = next(stokehold.PackedLoader(FIXTURES / "megatron_u16", seq_len=7, batch_size=1,
                                        windows="consecutive", shuffle="none").epoch(0))
    starts = np.flatnonzero(first["positions"][0, :-1] == 0).tolist()
    assert starts == [0, 5]  # document 0, then document 2 (document 1 is empty)
    torch = pytest.importorskip("torch")
    pos = torch.from_dlpack(first["positions"])[0, :-1]
    assert torch.nonzero(pos == 0).flatten().tolist() == starts


def test_packed_loader_shuffles_documents_per_epoch():
    # Token j of document i is 100 i + j: a window's documents are read from its tokens.
    lens = {0: 5, 2: 12, 3: 3, 4: 40, 5: 1}
    loader = stokehold.PackedLoader(FIXTURES / "megatron_u16", seq_len=7, batch_size=8,
                                    windows="consecutive", shuffle="none", seed=3,
                                    shuffle_documents=True)
    orders = []
    for epoch in range(4):
        b = next(loader.epoch(epoch))
        tokens = np.concatenate([b["tokens"][0]] + [t[1:] for t in b["tokens"][1:]])
        positions = np.concatenate([b["positions"][0]] + [p[1:] for p in b["positions"][1:]])
        np.testing.assert_array_equal(positions, tokens % 100)
        docs = [int(t) // 100 for t, p in zip(tokens, positions) if p == 0]
        # Each document once, whole but the last one reached (57 of the 61 tokens).
        assert sorted(docs) == sorted(set(docs)) and set(docs) <= set(lens)
        assert [int(n) for n in np.bincount(tokens // 100, minlength=6)[docs[:-1]]] == \
            [lens[d] for d in docs[:-1]]
        orders.append(docs)
    assert len({tuple(o) for o in orders}) > 1, orders
    assert any(o != sorted(o) for o in orders), orders


def test_arrow_tables_are_read_in_place():
    # As Hugging Face datasets writes a tokenised table (tests/fixtures/make_arrow.py).
    path = FIXTURES.parent / "arrow" / "hf_stream.arrow"
    lens = [5, 0, 12, 3, 40, 1]
    loader = stokehold.DocumentLoader(path, max_len=16, batch_size=4, shuffle="none")
    assert loader.columns["tokens"] == (np.dtype(np.int32), (16,))
    rows = [(list(t), int(n)) for b in loader.epoch(0) for t, n in zip(b["tokens"], b["len"])]
    want = [([100 * i + j for j in range(min(n, 16))] + [0] * (16 - min(n, 16)), min(n, 16))
            for i, n in enumerate(lens)]
    assert rows == want
    masks = stokehold.DocumentLoader(path, max_len=50, column="attention_mask", shuffle="none")
    assert [int(n) for b in masks.epoch(0) for n in b["len"]] == lens
    packed = stokehold.PackedLoader(path, seq_len=7, batch_size=8, windows="consecutive",
                                    shuffle="none")
    b = next(packed.epoch(0))
    stream = np.concatenate([100 * i + np.arange(n) for i, n in enumerate(lens)])
    np.testing.assert_array_equal(b["tokens"], np.stack([stream[7 * i:7 * i + 8] for i in range(8)]))
    with pytest.raises(stokehold.Error, match=r'hf_stream.arrow.*no column "labels"; its columns'):
        stokehold.DocumentLoader(path, max_len=16, column="labels")
    with pytest.raises(ValueError, match="not both"):
        stokehold.DocumentLoader(path, max_len=16, column="x", offsets=path)
    with pytest.raises(ValueError, match="is for an .arrow file"):
        stokehold.PackedLoader(FIXTURES / "megatron_u16", seq_len=7, column="input_ids")


def test_mds_datasets_are_read_in_place(tmp_path):
    # As streaming.MDSWriter writes them (tests/fixtures/make_mds.py): the documents but
    # the empty one, beside an int, a str and another array column, in two shards.
    root = FIXTURES.parent / "mds"
    lens = {0: 5, 2: 12, 3: 3, 4: 40, 5: 1}
    docs = [[100 * i + j for j in range(n)] for i, n in lens.items()]
    loader = stokehold.DocumentLoader(root / "mds_tokens", max_len=16, batch_size=4,
                                      shuffle="none")
    assert loader.columns["tokens"] == (np.dtype(np.uint16), (16,))
    rows = [(list(t), int(n)) for b in loader.epoch(0) for t, n in zip(b["tokens"], b["len"])]
    assert rows == [padded(d, 16, 0) for d in docs]
    masks = stokehold.DocumentLoader(root / "mds_tokens" / "shard.00001.mds", max_len=50,
                                     column="mask", shuffle="none")
    assert [int(n) for b in masks.epoch(0) for n in b["len"]] == [40, 1]
    # LLM Foundry's concatenated windows (ndarray:int32:8), packed again.
    stream = np.concatenate([np.array(d) for d in docs])
    packed = stokehold.PackedLoader(root / "mds_windows", seq_len=7, batch_size=8,
                                    windows="consecutive", shuffle="none")
    b = next(packed.epoch(0))
    assert b["tokens"].dtype == np.int32 and len(b) == 7  # 7 windows of 8 from 56 tokens
    np.testing.assert_array_equal(b["tokens"], np.stack([stream[7 * i:7 * i + 8] for i in range(7)]))
    np.testing.assert_array_equal(b["positions"][:2], [np.arange(8), [7, 0, 1, 2, 3, 4, 5, 6]])
    with pytest.raises(stokehold.Error, match=r"shard.00000.mds.zstd: a compressed shard"):
        stokehold.DocumentLoader(root / "mds_zstd", max_len=16)
    with pytest.raises(stokehold.Error, match=r"shard.00000.mds.zstd: a zstd-compressed shard"):
        stokehold.DocumentLoader(root / "mds_zstd" / "shard.00000.mds.zstd", max_len=16)
    # The index itself names its directory.
    assert len(stokehold.DocumentLoader(root / "mds_tokens" / "index.json", max_len=16)) == 1
    # A plain ndarray column: each sample names its type (int64).
    dynamic = stokehold.DocumentLoader(root / "mds_dynamic", max_len=16, shuffle="none",
                                       batch_size=8)
    b = next(dynamic.epoch(0))
    assert b["tokens"].dtype == np.int64 and list(b["len"]) == [5, 12, 3, 16, 1]
    (tmp_path / "index.json").write_text('{"shards": [{"format": "json"}]}')
    with pytest.raises(stokehold.Error, match="index.json: not the index.json of an MDS"):
        stokehold.DocumentLoader(tmp_path, max_len=16)
    (tmp_path / "index.json").write_text('{"shards": []}')
    with pytest.raises(stokehold.Error, match="index.json: an MDS index that lists no shards"):
        stokehold.DocumentLoader(tmp_path, max_len=16)


def test_mds_bytes_columns_take_their_type():
    # Older LLM Foundry sets: int64 tokens as raw bytes (tests/fixtures/make_mds.py).
    root = REPO / "tests" / "fixtures" / "mds"
    docs = [100 * i + np.arange(n) for i, n in {0: 5, 2: 12, 3: 3, 4: 40, 5: 1}.items()]
    loader = stokehold.DocumentLoader(root / "mds_bytes", max_len=16, dtype="int64",
                                      shuffle="none", batch_size=8)
    b = next(loader.epoch(0))
    assert b["tokens"].dtype == np.int64 and list(b["len"]) == [5, 12, 3, 16, 1]
    for row, n, d in zip(b["tokens"], b["len"], docs):
        np.testing.assert_array_equal(row[:n], d[:16])
    packed = stokehold.PackedLoader(root / "mds_bytes", seq_len=60, dtype="int64",
                                    windows="consecutive", shuffle="none")
    np.testing.assert_array_equal(next(packed.epoch(0))["tokens"][0], np.concatenate(docs))
    with pytest.raises(stokehold.Error, match='encoded as "bytes": give the integer type'):
        stokehold.DocumentLoader(root / "mds_bytes", max_len=16)
    with pytest.raises(stokehold.Error, match="sample 2: its array lies outside"):
        stokehold.DocumentLoader(root / "mds_bytes_cut", max_len=16, dtype="int64")
    with pytest.raises(ValueError, match="dtype is for an .mds shard"):
        stokehold.DocumentLoader(root / "x.arrow", max_len=16, dtype="int64")
    with pytest.raises(ValueError, match="dtype 'int65'|dtype \"int65\""):
        stokehold.DocumentLoader(root / "mds_bytes", max_len=16, dtype="int65")


def test_shards_of_a_table_are_one_set(tmp_path):
    # A directory of .arrow shards, as datasets' save_to_disk writes one, or a list.
    src = FIXTURES.parent / "arrow" / "hf_stream.arrow"
    for k in range(3):
        (tmp_path / f"data-0000{k}-of-00003.arrow").write_bytes(src.read_bytes())
    # A save_to_disk directory's state.json lists the table's shards in order.
    (tmp_path / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": f"data-0000{k}-of-00003.arrow"} for k in range(3)]}))
    (tmp_path / "cache-1234.arrow").write_bytes(b"not a shard of the table")
    lens = [5, 0, 12, 3, 40, 1]
    for path in (tmp_path, sorted(tmp_path.glob("data-*.arrow"))):
        loader = stokehold.DocumentLoader(path, max_len=64, batch_size=5, shuffle="full", seed=3)
        assert len(loader) == 4  # 18 documents
        got = sorted((int(i), int(n)) for b in loader.epoch(0) for i, n in zip(b.indices, b["len"]))
        assert got == list(enumerate(lens * 3))
    packed = stokehold.PackedLoader(tmp_path, seq_len=20, batch_size=4)
    assert len(packed) == 3 * 3 // 4 + 1  # 3 windows of 21 from each shard's 61 tokens
    with pytest.raises(stokehold.Error, match="part 1 of a concatenation has the columns"):
        stokehold.DocumentLoader([src, FIXTURES / "megatron_u16"], max_len=64)
    with pytest.raises(ValueError, match="without offsets"):
        stokehold.DocumentLoader([src, src], max_len=64, offsets=src)
    (tmp_path / "empty").mkdir()
    with pytest.raises(stokehold.Error, match="a directory without a saved table"):
        stokehold.DocumentLoader(tmp_path / "empty", max_len=64)


def test_packed_windows_resume_exactly(tmp_path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 50_000, size=n, dtype=np.uint16) for n in rng.integers(0, 300, 400)]
    np.concatenate(docs).tofile(tmp_path / "tokens.bin")
    np.save(tmp_path / "tokens.npy", np.concatenate(docs))
    np.save(tmp_path / "offsets.npy", np.concatenate([[0], np.cumsum([len(d) for d in docs])]))
    stream = np.concatenate(docs)

    def make():
        return stokehold.PackedLoader(tmp_path / "tokens.npy", seq_len=128, batch_size=8,
                                      offsets=tmp_path / "offsets.npy", seed=2, workers=2)

    it = make().epoch(1)
    first = [next(it) for _ in range(2)]
    for b in first:
        assert b["tokens"].shape == (8, 129)
        for t in b["tokens"]:
            # Each window is a run of the concatenation (random offsets).
            at = np.flatnonzero(stream[:len(stream) - 128] == t[0])
            assert any(np.array_equal(stream[a:a + 129], t) for a in at)
    state = json.loads(json.dumps(it.state_dict()))
    again = make()
    again.load_state_dict(state)
    rest = [b["tokens"].copy() for b in again.epoch(1)]
    whole = [b["tokens"].copy() for b in make().epoch(1)]
    got = np.concatenate([b["tokens"].copy() for b in first] + rest)
    np.testing.assert_array_equal(got, np.concatenate(whole))


def test_documents_shuffle_once_per_epoch_and_resume_exactly(tmp_path):
    # A Megatron set written as Megatron-Core's IndexedDatasetBuilder writes one.
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 50_000, size=n, dtype=np.uint16) for n in rng.integers(0, 300, 500)]
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * 2)])
    with open(tmp_path / "set.bin", "wb") as f:
        for d in docs:
            f.write(d.tobytes())
    with open(tmp_path / "set.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + np.uint8(8).tobytes())
        f.write(np.uint64(len(docs)).tobytes() + np.uint64(len(docs) + 1).tobytes())
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes())
        f.write(np.arange(len(docs) + 1, dtype=np.int64).tobytes())

    def make():
        return stokehold.DocumentLoader(tmp_path / "set", max_len=256, batch_size=32, seed=9,
                                        workers=2)

    loader = make()
    seen = []
    for b in loader.epoch(1):
        for i, t, n in zip(b.indices, b["tokens"], b["len"]):
            d = docs[int(i)][:256]
            assert n == len(d)
            np.testing.assert_array_equal(t[:n], d)
            assert not t[n:].any()
            seen.append(int(i))
    assert sorted(seen) == list(range(len(docs)))
    it = make().epoch(2)
    first = [next(it).indices.copy() for _ in range(3)]
    state = json.loads(json.dumps(it.state_dict()))
    again = make()
    again.load_state_dict(state)
    rest = [b.indices.copy() for b in again.epoch(2)]
    whole = [b.indices.copy() for b in make().epoch(2)]
    np.testing.assert_array_equal(np.concatenate(first + rest), np.concatenate(whole))

    # Grouped by length: each document once, and far less padding once each batch is
    # cut to its longest row.
    def padding(shuffle):
        loader = stokehold.DocumentLoader(tmp_path / "set", max_len=256, batch_size=16,
                                          shuffle=shuffle, seed=1)
        seen, pad, total = [], 0, 0
        for b in loader.epoch(0):
            seen.extend(int(i) for i in b.indices)
            n = b["len"]
            pad += int((n.max() - n).sum())
            total += int(n.max()) * len(n)
        assert sorted(seen) == list(range(len(docs)))
        return pad / total

    assert padding("grouped") < padding("full") / 3

    # Elastic with a grouped shuffle: two ranks take 3 batches each, then three ranks
    # share out the rest, each document once. The group must be given: left to the
    # loader it follows batch and world size, and the resume is refused, saying so.
    def ranks(world, **kw):
        return [stokehold.DocumentLoader(tmp_path / "set", max_len=256, batch_size=16,
                                         shuffle="grouped", seed=4, rank=r,
                                         world_size=world, **kw) for r in range(world)]

    taken, state = [], None
    for loader in ranks(2, group=256):
        it = loader.epoch(0)
        for _ in range(3):
            taken.extend(int(i) for i in next(it).indices)
        state = it.state_dict()
    for loader in ranks(3, group=256):
        loader.load_state_dict(state, elastic=True)
        taken.extend(int(i) for b in loader.epoch(0) for i in b.indices)
    # Each document once, but those the three ranks pad their share of the rest with.
    pad = -(len(docs) - 2 * 3 * 16) % 3
    assert set(taken) == set(range(len(docs))) and len(taken) == len(docs) + pad
    with pytest.raises(stokehold.Error, match="group, here 3072"):
        ranks(3)[0].load_state_dict(state, elastic=True)
    with pytest.raises(ValueError, match="group goes with"):
        stokehold.DocumentLoader(tmp_path / "set", max_len=256, group=64)
    with pytest.raises(stokehold.Error, match="grouped shuffle"):
        stokehold.Loader(FIXTURES / "dir", shuffle="grouped")


def test_a_mix_gives_each_source_its_share_and_resumes(tmp_path):
    # Two corpora of 64-token windows: "web" (token i is i % 30000) and "code" (30000 +
    # i % 3000), with 300 and 20 windows; code is upsampled to a quarter of the epoch.
    streams = {"web": np.arange(300 * 64 + 1) % 30_000, "code": 30_000 + np.arange(20 * 64 + 1) % 3_000}
    sources = []
    for name, tokens in streams.items():
        tokens.astype(np.uint16).tofile(tmp_path / f"{name}.bin")
        sources.append(stokehold.TokenLoader(tmp_path / f"{name}.bin", seq_len=64, windows="consecutive"))
    mix = lambda **kw: stokehold.MixLoader(sources, weights=[3, 1], samples=400, batch_size=16,
                                           seed=5, **kw)
    loader = mix(workers=2)
    assert loader.takes == [300, 100] and len(loader) == 25
    assert list(loader.columns) == ["tokens"]
    for epoch in range(2):
        seen, per_source = [], [0, 0]
        for b in loader.epoch(epoch):
            parts, samples = loader.source(epoch, b.indices)
            for row, p, s in zip(b["tokens"], parts, samples):
                want = list(streams.values())[p][64 * s:64 * s + 65]
                np.testing.assert_array_equal(row, want)
                per_source[p] += 1
            seen.extend(b.indices.tolist())
        assert sorted(seen) == list(range(400)) and per_source == [300, 100]
    # Resumed through JSON after 6 batches: the rest of the epoch, on another worker count.
    whole = [b.indices.copy() for b in loader.epoch(1)]
    it = loader.epoch(1)
    head = [next(it).indices.copy() for _ in range(6)]
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = mix(workers=1)
    resumed.load_state_dict(state)
    tail = [b.indices.copy() for b in resumed.epoch(1)]
    np.testing.assert_array_equal(np.concatenate(head + tail), np.concatenate(whole))
    # Bad mixes are errors.
    short = stokehold.TokenLoader(tmp_path / "web.bin", seq_len=32)
    with pytest.raises(stokehold.Error, match="part 1 of a mix has the columns"):
        stokehold.MixLoader([sources[0], short], weights=[1, 1])
    with pytest.raises(stokehold.Error, match="weight -1 of part 1"):
        stokehold.MixLoader(sources, weights=[1, -1])
    with pytest.raises(stokehold.Error, match="2 parts was given 1 weights"):
        stokehold.MixLoader(sources, weights=[1])
    with pytest.raises(TypeError, match="not str"):
        stokehold.MixLoader([sources[0], "code.bin"], weights=[1, 1])
    with pytest.raises(IndexError, match="position 400"):
        loader.source(0, [400])
    with pytest.raises(IndexError, match="position -1"):
        loader.source(0, [3, -1])
    with pytest.raises(TypeError, match="integers, not float64"):
        loader.source(0, [1.5])


@pytest.fixture
def no_gc():
    """No loader left by another test is collected (and its threads joined) meanwhile."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_mix_frees_its_sources_buffers_and_threads(tmp_path, no_gc):
    tasks = lambda: len(os.listdir("/proc/self/task"))
    np.arange(20_000, dtype=np.uint16).tofile(tmp_path / "a.bin")
    make = lambda: stokehold.TokenLoader(tmp_path / "a.bin", seq_len=64, workers=2)
    before = tasks()
    one = make()
    per_loader = tasks() - before
    assert per_loader >= 2
    del one
    assert tasks() == before
    fresh, used = make(), make()
    first = [b.indices.copy() for b in used.epoch(0)]
    mix = stokehold.MixLoader([fresh, used], weights=[1, 1], workers=2)
    # The fresh source gave its threads back; the one already iterated kept them.
    assert tasks() == before + 2 * per_loader
    assert [b.indices.copy() for b in mix.epoch(0)]
    # Used on its own again, the fresh source starts afresh.
    again = [b.indices.copy() for b in fresh.epoch(0)]
    assert tasks() == before + 3 * per_loader
    np.testing.assert_array_equal(np.concatenate(again), np.concatenate(first))
    assert fresh.info()["buffers"] == used.info()["buffers"]


def test_the_report(cols):
    loader = stokehold.Loader(cols, batch_size=100, workers=2)
    report = stokehold.TrainReport(loader)
    for e in range(3):
        timer = stokehold.EpochTimer(loader.epoch(e))
        for batch in timer:
            loss_sum, correct = timer.step(lambda b: (0.5 * len(b), len(b) // 2), batch)
            timer.record(loss_sum, correct, len(batch))
        row = timer.finish()
        assert row["samples"] == N
        assert abs(row["loss"] - 0.5) < 1e-9
        report.push(row)
    text = str(report)
    assert "samples/s" in text and "epoch 0 took" in text
    j = report.json()
    assert len(j["epochs"]) == 3
    assert "warmup" in j and "cold_cache_s" in j["warmup"]
    json.dumps(j)


def test_the_report_refuses_what_would_make_its_figures_wrong(cols):
    loader = stokehold.Loader(cols, batch_size=100, workers=2)
    other = stokehold.Loader(cols, batch_size=100, workers=2)
    report = stokehold.TrainReport(loader)
    epoch = loader.epoch(0)
    timer = stokehold.EpochTimer(epoch)
    assert len(timer) == len(loader)
    with pytest.raises(stokehold.Error, match="already has an EpochTimer"):
        stokehold.EpochTimer(epoch)
    # Counts are whole and hold together; a float or a negative one names them.
    batch = next(timer)
    for bad, kind in (((1.0, -1, len(batch)), ValueError), ((1.0, 5, 4), ValueError),
                      ((1.0, 0.7, 1), TypeError)):
        with pytest.raises(kind, match="correct"):
            timer.record(*bad)
    timer.record(0.5 * len(batch), 1, len(batch))
    with pytest.raises(stokehold.Error, match="before the epoch's last batch"):
        timer.finish()
    for b in timer:
        timer.record(0.5 * len(b), 1, len(b))
    # Times that are not seconds are refused before the epoch's row is taken.
    residency = loader._raw.residency()
    for bad in (float("nan"), float("inf"), 1e300):
        with pytest.raises(ValueError, match="wall_s"):
            epoch._raw.row(bad, 0.0, 0.0, 0.0, 0.0, 0, 0, residency)
    row = timer.finish()
    with pytest.raises(stokehold.Error, match="finished already"):
        timer.finish()
    report.push(row)
    with pytest.raises(ValueError, match="epoch 0 is in the report already"):
        report.push(row)
    theirs = stokehold.EpochTimer(other.epoch(1))
    with pytest.raises(ValueError, match="another loader"):
        report.push(theirs.finish(partial=True))
    # A loop that stops early has its partial row when it asks for one.
    early = stokehold.EpochTimer(loader.epoch(1))
    b = next(early)
    early.record(0.0, 0, len(b))
    assert early.finish(partial=True)["samples"] == len(b)
    # The wrong objects are TypeErrors, not AttributeErrors about private names.
    with pytest.raises(TypeError, match="loader.epoch"):
        stokehold.EpochTimer(loader)
    with pytest.raises(TypeError, match="Loader"):
        stokehold.TrainReport(loader.epoch(2))
    with pytest.raises(TypeError, match="EpochRow"):
        report.push(row.as_dict())
    # info() reads the loader as built: the running epoch goes on.
    running = loader.epoch(3)
    next(running)
    assert loader.info()["buffers"] > 0
    assert sum(1 for _ in running) == len(loader) - 1


def test_an_epoch_run_to_its_end_gives_its_row_after_the_next_starts(cols):
    loader = stokehold.Loader(cols, batch_size=100, workers=2)
    timer = stokehold.EpochTimer(loader.epoch(0))
    for batch in timer:
        timer.record(0.0, 0, len(batch))
    following = loader.epoch(1)  # e.g. a loop that starts the next epoch, then reports
    row = timer.finish()
    assert row["samples"] == N and len(following) == len(loader)


def test_digits_ships_and_loads():
    digits = REPO / "datasets" / "digits"
    if not digits.exists():
        pytest.skip("no datasets/digits")
    loader = stokehold.Loader(digits, batch_size=128)
    assert sum(len(b) for b in loader.epoch(0)) == 1797
