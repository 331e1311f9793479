"""Device batches (``device="cuda"``): on stokehold's CPU emulator of the CUDA driver
(``tests/emu``, built here with the system C++ compiler) everywhere, and with PyTorch on
a real GPU where there is one.

cudarc opens libcuda once per process, so each emulated check runs in a child Python
with the emulator first on its library path. The child plays the consumer through the
driver API (ctypes): its own stream, named to ``__dlpack__``, reads each batch back
behind a delay, after the batch is already released; a slot copied into again before
the consumer's stream passed it, or a read that did not wait for the copy, shows as
wrong rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import stokehold

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "datasets" / "digits"
EMU = ROOT / "tests" / "emu"
REQUIRE_GPU = os.environ.get("STOKEHOLD_REQUIRE_GPU") == "1"


@pytest.fixture(scope="session")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = os.environ.get("STOKEHOLD_EMU_CXX", "c++")
    if shutil.which(cxx) is None:
        # CI has one: there the emulated checks must run, not pass by skipping.
        if os.environ.get("STOKEHOLD_REQUIRE_EMULATOR") == "1":
            pytest.fail(f"STOKEHOLD_REQUIRE_EMULATOR=1 but no C++ compiler ({cxx})")
        pytest.skip(f"no C++ compiler ({cxx}) to build the CUDA emulator")
    out = tmp_path_factory.mktemp("emu")
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Werror",
         "-o", str(out / "libcuda.so.1"), str(EMU / "cuda.cpp"), "-ldl", "-lpthread"],
        check=True,
    )
    (out / "libcuda.so").symlink_to("libcuda.so.1")
    # NVRTC too, for the kernels the device runs (augmentation).
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Werror",
         f'-DEMU_PRELUDE="{EMU / "prelude.h"}"',
         "-o", str(out / "libnvrtc.so"), str(EMU / "nvrtc.cpp")],
        check=True,
    )
    return out


# The consumer's side, through the driver API: shared by the children.
CONSUMER = textwrap.dedent(
    """
    import ctypes, pickle, sys, time
    import numpy as np
    import stokehold

    cuda = ctypes.CDLL("libcuda.so.1")
    py = ctypes.pythonapi
    py.PyCapsule_GetPointer.restype = ctypes.c_void_p
    py.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    py.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    for f in ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoH_v2"):
        getattr(cuda, f).argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t] + (
            [ctypes.c_void_p] if "Async" in f else [])
    cuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    cuda.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    class DLManagedTensor(ctypes.Structure):
        pass

    DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
    DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                                ("deleter", DELETER)]

    def ok(r, what):
        assert r == 0, f"{what}: CUresult {r}"

    def tensor(capsule):
        p = py.PyCapsule_GetPointer(capsule, b"dltensor")
        return ctypes.cast(p, ctypes.POINTER(DLManagedTensor))

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def slow(_):
        time.sleep(0.003)

    def raises(call, text):
        try:
            call()
        except stokehold.Error as e:
            assert text in str(e), e
            return e
        raise AssertionError(f"no error saying {text!r}")

    def host_order(**kw):
        # The samples of each batch of epoch 0 of a host loader over the set.
        return [b.indices.copy() for b in stokehold.Loader(sys.argv[1], **kw).epoch(0)]

    def current():
        # The thread's current context (None: none), which stokehold puts back after
        # each call: a consumer's own (PyTorch's device) stays current.
        c = ctypes.c_void_p()
        ok(cuda.cuCtxGetCurrent(ctypes.byref(c)), "cuCtxGetCurrent")
        return c.value

    def bind():
        # What a consumer does before its own CUDA work (PyTorch, on its device).
        ctx = ctypes.c_void_p()
        ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
        ok(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def device_bytes(ptr, n):
        # `n` bytes of device memory at `ptr`, read back synchronously in the consumer's
        # own context.
        bind()
        back = (ctypes.c_uint8 * n)()
        ok(cuda.cuMemcpyDtoH_v2(back, ptr, n), "cuMemcpyDtoH")
        return np.frombuffer(back, np.uint8)

    def device_array(batch, name, like):
        # Column `name` of a device batch, read back laid out as the host array `like`
        # (its capsule kept alive for the read).
        capsule = batch[name].__dlpack__(stream=None)
        t = tensor(capsule).contents.dl_tensor
        like = np.ascontiguousarray(like)
        return device_bytes(t.data, like.nbytes).view(like.dtype).reshape(like.shape)

    def pinned(n):
        p = ctypes.c_void_p()
        ok(cuda.cuMemHostAlloc(ctypes.byref(p), n, 0), "cuMemHostAlloc")
        return p

    x_file = np.load(sys.argv[1] + "/x.npy")
    """
)


def run_child(emulator: Path, body: str, jitter_us: int = 200,
              extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(extra or {})
    env["LD_LIBRARY_PATH"] = f"{emulator}:{env.get('LD_LIBRARY_PATH', '')}"
    env["STOKEHOLD_EMU_JITTER_US"] = str(jitter_us)
    env["TMPDIR"] = str(emulator)
    env["STOKEHOLD_NVRTC"] = str(emulator / "libnvrtc.so")
    env["STOKEHOLD_CACHE"] = str(emulator / "kernel-cache")
    script = CONSUMER + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", script, str(DIGITS)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, f"child failed:\n{out.stdout}\n{out.stderr}"
    assert "child passed" in out.stdout, out.stdout + out.stderr
    return out


def test_device_batches_wait_for_their_copy_and_their_consumer(emulator: Path) -> None:
    run_child(emulator, """
        loader = stokehold.Loader(sys.argv[1], batch_size=100, seed=3, workers=2,
                                  device="cuda", held=1)
        assert current() is None, "the loader left its context current"
        bind()
        stream = ctypes.c_void_p()
        ok(cuda.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")
        reads, kept = [], None
        for i, batch in enumerate(loader.epoch(0)):
            assert isinstance(batch, stokehold.DeviceBatch)
            x = batch["x"]
            assert x.__dlpack_device__() == (2, 0)
            assert x.shape == (len(batch), 8, 8) and x.dtype == np.uint8 and x.nbytes == len(batch) * 64
            capsule = x.__dlpack__(stream=stream.value)
            managed = tensor(capsule)
            t = managed.contents.dl_tensor
            assert (t.device.device_type, t.ndim, t.dtype.code, t.dtype.bits) == (2, 3, 1, 8)
            assert [t.shape[k] for k in range(3)] == [len(batch), 8, 8]
            n = len(batch) * 64
            host = pinned(n)
            # The consumer's read runs late, after the batch is released below.
            ok(cuda.cuLaunchHostFunc(stream, ctypes.cast(slow, ctypes.c_void_p), None), "host func")
            ok(cuda.cuMemcpyDtoHAsync_v2(host, t.data, n, stream), "cuMemcpyDtoHAsync")
            reads.append((batch.indices.copy(), host, n))
            if i == 1:
                # A consumer takes the tensor (as torch.from_dlpack does) and keeps it:
                # its slot is not copied into until the consumer deletes it.
                py.PyCapsule_SetName(capsule, b"used_dltensor")
                kept = (managed, t.data, batch.indices.copy(), n)
            del x, capsule, batch
        ok(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
        for indices, host, n in reads:
            got = np.ctypeslib.as_array(ctypes.cast(host, ctypes.POINTER(ctypes.c_uint8)), (n,))
            assert np.array_equal(got, x_file[indices].reshape(-1)), "a slot was overwritten or read early"
        managed, data, indices, n = kept
        assert np.array_equal(device_bytes(data, n), x_file[indices].reshape(-1)), \
            "a slot a consumer still owned was copied into"
        managed.contents.deleter(managed)
        # Every slot back: a whole epoch again, each batch dropped at once.
        assert sum(len(b) for b in loader.epoch(1)) == 1797
        print("child passed")
    """)


def test_the_loader_leaves_the_threads_context_as_it_found_it(emulator: Path) -> None:
    # A thread's current context is its device for the CUDA runtime (PyTorch's
    # current_device): none here before, none after building, iterating, holding and
    # dropping device loaders, augmented or not.
    run_child(emulator, """
        assert current() is None
        for kw in ({}, {"augment": stokehold.Augment("x", crop=1, flip=True)}):
            loader = stokehold.Loader(sys.argv[1], batch_size=100, device="cuda", **kw)
            assert current() is None, f"building {kw} left its context current"
            kept = [b for b, _ in zip(loader.epoch(0), range(2))]
            assert current() is None, "lending left its context current"
            assert sum(len(b) for b in loader.epoch(1)) == 1797
            assert current() is None, "an epoch left its context current"
            del kept, loader
            assert current() is None, "dropping the loader left its context current"
        # A build that fails after the context was made drops its last handle.
        raises(lambda: stokehold.Loader(sys.argv[1], device="cuda",
                                        augment=stokehold.Augment("nope")), "nope")
        assert current() is None, "a failed build left its context current"
        print("child passed")
    """)


def test_holding_every_slot_is_an_error_not_a_hang(emulator: Path) -> None:
    run_child(emulator, """
        loader = stokehold.Loader(sys.argv[1], batch_size=100, device="cuda", held=1)
        epoch = loader.epoch(0)
        held = [next(epoch) for _ in range(3)]
        assert len({b.slot for b in held}) == 3
        raises(lambda: next(epoch), "device slots")  # a fourth batch, three slots held
        # The batch refused a slot is still the epoch's: one slot freed, it comes next.
        assert loader.state_dict()["batch"] == 3, "a batch was taken, then refused a slot"
        del held[0]
        fourth = next(epoch)
        want = host_order(batch_size=100)
        assert np.array_equal(fourth.indices, want[3])
        # Dropping them frees the slots: the next epoch runs whole.
        del held, epoch, fourth
        assert sum(len(b) for b in loader.epoch(1)) == 1797
        # More slots than the device holds are refused before any is allocated.
        for many in (2**40, 2**64 - 1):
            try:
                stokehold.Loader(sys.argv[1], batch_size=100, device="cuda", held=many)
            except (ValueError, stokehold.Error) as e:
                assert "slots" in str(e), e
            else:
                raise AssertionError(f"held={many} accepted")
        # Token streams go to the device too, and the interface for CuPy/Numba answers.
        tokens = np.arange(5000, dtype=np.uint16)
        path = sys.argv[1] + "/../../target/tokens-device-test.bin"
        tokens.tofile(path)
        tl = stokehold.TokenLoader(path, seq_len=16, batch_size=4, device="cuda")
        b = next(iter(tl.epoch(0)))
        cai = b["tokens"].__cuda_array_interface__
        assert cai["shape"] == (4, 17) and cai["typestr"] == "<u2" and cai["version"] == 3
        assert b["tokens"].__cuda_array_interface__ == cai  # probed again (waits once)
        got = device_bytes(cai["data"][0], 136).view(np.uint16).reshape(4, 17)
        assert (np.diff(got.astype(np.int64), axis=1) == 1).all(), got
        print("child passed")
    """)


def test_ctrl_c_stops_a_wait_for_a_device_slot(emulator: Path) -> None:
    run_child(emulator, """
        import os, signal, threading
        # Python's own handler, whatever the parent left (a background job ignores SIGINT).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Every slot lent to batches used on another thread, which keeps them until
        # told: the loop's wait for a slot lasts as long, and Ctrl-C must stop it.
        loader = stokehold.Loader(sys.argv[1], batch_size=100, device="cuda", held=1)
        epoch = loader.epoch(0)
        kept = [next(epoch) for _ in range(3)]
        used, release = threading.Event(), threading.Event()

        def keep():
            for b in kept:
                b.synchronize()  # used here: the slots wait for this thread
            used.set()
            release.wait(5)
            kept.clear()

        keeper = threading.Thread(target=keep, daemon=True)
        keeper.start()
        assert used.wait(10)
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            next(epoch)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the wait for a slot went on through Ctrl-C")
        # Nothing was taken: the batch the wait was for comes next.
        assert loader.state_dict()["batch"] == 3, loader.state_dict()
        release.set()
        keeper.join(10)
        want = host_order(batch_size=100)
        assert np.array_equal(next(epoch).indices, want[3])
        print("child passed")
    """)


def test_a_batch_whose_copy_failed_comes_again_after_a_resume(emulator: Path) -> None:
    # The third copy to the device fails (the emulator's STOKEHOLD_EMU_FAIL_HTOD): the
    # batch was taken from the epoch, and the state must not count it, or a checkpoint
    # saved in the handler would skip it.
    run_child(emulator, """
        loader = stokehold.Loader(sys.argv[1], batch_size=100, seed=5, device="cuda")
        want = host_order(batch_size=100, seed=5)
        it = loader.epoch(0)
        assert np.array_equal(next(it).indices, want[0])
        assert np.array_equal(next(it).indices, want[1])
        e = raises(lambda: next(it), "CUDA_ERROR_INVALID_VALUE")
        # A refused copy leaves the context usable.
        assert (e.cuda_code, e.context_lost) == (1, False), (e.cuda_code, e.context_lost)
        state = loader.state_dict()
        assert (state["epoch"], state["batch"]) == (0, 2), state
        # The epoch ended there; its figures are still there to read, and going on
        # with it raises the error again rather than stop as if it were whole.
        assert it.stats()["batches"] == 3, it.stats()
        raises(lambda: next(it), "epoch 0 ended with an error at batch 2")
        fresh = stokehold.Loader(sys.argv[1], batch_size=100, seed=5, device="cuda")
        fresh.load_state_dict(state)
        rest = [b.indices.copy() for b in fresh.epoch(0)]
        assert len(rest) == len(want) - 2
        assert all(np.array_equal(a, b) for a, b in zip(rest, want[2:]))
        print("child passed")
    """, extra={"STOKEHOLD_EMU_FAIL_HTOD": "3"})


@pytest.mark.parametrize("faulting", [3, 18])
def test_a_copy_that_faults_on_the_device_loses_no_batch(emulator: Path, faulting: int) -> None:
    # Copy `faulting` (from 1) faults on the device once it runs (the emulator's
    # STOKEHOLD_EMU_FAIL_HTOD_LATE): the context then fails every call, as after a fault
    # on a GPU. A later batch's lend finds it, or, for the epoch's last batch (18 of
    # 100 samples), the epoch's end. The state must go back at least to the faulting
    # batch (its copy was lost): a resume in a new process yields the rest. Nothing
    # crashes or hangs as the batches and the loader of the lost context are let go.
    out = run_child(emulator, """
        import json
        loader = stokehold.Loader(sys.argv[1], batch_size=100, seed=7, device="cuda")
        want = host_order(batch_size=100, seed=7)
        got, kept = [], []
        try:
            for b in loader.epoch(0):
                got.append(b.indices.copy())
                kept = (kept + [b])[-2:]  # a loop that overlaps its steps keeps two
        except stokehold.Error as e:
            assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(e), e
            # A fault loses the context: the error says so, and it survives a pickle.
            assert (e.cuda_code, e.context_lost) == (700, True), (e.cuda_code, e.context_lost)
            again = pickle.loads(pickle.dumps(e))
            assert (again.cuda_code, again.context_lost) == (700, True), vars(again)
        else:
            raise AssertionError("the fault went unreported")
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        state = loader.state_dict()
        print("state", json.dumps(state))
        del kept, loader
        print("child passed")
    """, extra={"STOKEHOLD_EMU_FAIL_HTOD_LATE": str(faulting)})
    line = next(x for x in out.stdout.splitlines() if x.startswith("state "))
    state = line.split(" ", 1)[1]
    batch = json.loads(state)["batch"]
    assert json.loads(state)["epoch"] == 0, state
    assert batch in (faulting - 2, faulting - 1), f"copy {faulting} faulted, the state is {state}"
    run_child(emulator, f"""
        import json
        want = host_order(batch_size=100, seed=7)
        loader = stokehold.Loader(sys.argv[1], batch_size=100, seed=7, device="cuda")
        loader.load_state_dict(json.loads({state!r}))
        rest = [b.indices.copy() for b in loader.epoch(0)]
        assert len(rest) == len(want) - {batch}, len(rest)
        assert all(np.array_equal(a, b) for a, b in zip(rest, want[{batch}:]))
        print("child passed")
    """)


def test_a_fault_found_by_a_partial_rows_drain_rewinds_the_state(emulator: Path) -> None:
    # The third copy faults once it runs; the loop takes three batches and stops early.
    # The row's drain finds the fault: the row fails, and the state goes back to the
    # batch whose copy was lost, so a checkpoint saved then yields it again.
    run_child(emulator, """
        loader = stokehold.Loader(sys.argv[1], batch_size=100, seed=7, device="cuda")
        timer = stokehold.EpochTimer(loader.epoch(0))
        for n, batch in enumerate(timer):
            timer.record(0.0, 0, len(batch))
            if n == 2:
                break
        del batch
        e = raises(lambda: timer.finish(partial=True), "CUDA_ERROR_ILLEGAL_ADDRESS")
        state = loader.state_dict()
        assert (state["epoch"], state["batch"]) == (0, 2), state
        print("child passed")
    """, extra={"STOKEHOLD_EMU_FAIL_HTOD_LATE": "3"})


def test_a_forked_child_refuses_device_batches_and_lets_them_go(emulator: Path) -> None:
    # CUDA cannot be used in a forked child (a DataLoader worker): a device batch the
    # child inherited raises there instead of calling the driver, and dropping it (and
    # a tensor made from it) calls nothing; the parent's batch and slots are unharmed.
    run_child(emulator, """
        import os
        loader = stokehold.Loader(sys.argv[1], batch_size=100, device="cuda", held=1)
        it = loader.epoch(0)
        batch = next(it)
        capsule = batch["x"].__dlpack__(stream=1)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                raises(lambda: batch["x"].__dlpack__(stream=1), "forked child")
                raises(lambda: batch["y"], "forked child")  # a column not read before
                raises(lambda: batch["x"].__cuda_array_interface__, "forked child")
                raises(batch.synchronize, "forked child")
                del batch, capsule
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        n = len(batch) * 64
        assert np.array_equal(device_bytes(batch["x"].data_ptr, n), x_file[batch.indices].reshape(-1))
        del batch, capsule
        assert sum(len(b) for b in it) == 1797 - 100
        print("child passed")
    """)


def test_a_device_epoch_ends_at_once_and_a_small_pool_keeps_going(emulator: Path) -> None:
    run_child(emulator, """
        # Four batches, four slots (held=2): a loop that keeps them all ends its epoch
        # as any other, without waiting for a fifth slot.
        loader = stokehold.Loader(sys.argv[1], batch_size=450, device="cuda", held=2)
        it = loader.epoch(0)
        kept = list(it)
        assert [len(b) for b in kept] == [450, 450, 450, 447], [len(b) for b in kept]
        del kept
        assert next(it, None) is None
        # The state moves on to the next epoch, as on the host.
        state = loader.state_dict()
        assert (state["epoch"], state["batch"]) == (1, 0), state
        loader.epoch(1)
        assert next(it, None) is None, "an exhausted epoch raised once another started"
        # One buffer ahead and none held: the host batches whose copies run are the
        # device slots' to keep, not the loop's, and the workers still get buffers.
        small = stokehold.Loader(sys.argv[1], batch_size=100, device="cuda", prefetch=1, held=0)
        for epoch in range(2):
            assert sum(len(b) for b in small.epoch(epoch)) == 1797
        print("child passed")
    """)


def test_dlpack_keywords_as_consumers_pass_them(emulator: Path) -> None:
    run_child(emulator, """
        # torch >= 2.4 asks with max_version and dl_device; the array API lets a consumer
        # ask for a copy or a device, or name no stream (-1). Each is answered or refused
        # as the DLPack protocol says, and the tensor holds the batch's rows.
        loader = stokehold.Loader(sys.argv[1], batch_size=100, seed=2, device="cuda")
        bind()
        stream = ctypes.c_void_p()
        ok(cuda.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")
        for i, batch in enumerate(loader.epoch(0)):
            x = batch["x"]
            want = x_file[batch.indices]
            if i == 0:
                capsule = x.__dlpack__(stream=stream.value, max_version=(1, 0),
                                       dl_device=(2, 0), copy=False)
                ok(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
            elif i == 1:
                # No wait asked for: the consumer orders itself, here by waiting for all.
                capsule = x.__dlpack__(stream=-1)
                ok(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
            elif i == 2:
                capsule = x.__dlpack__(stream=2)  # the per-thread default stream
                ok(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
            else:
                for kw, text in [({"dl_device": (1, 0)}, "cannot be exported"),
                                 ({"dl_device": (2, 1)}, "cannot be exported"),
                                 ({"copy": True}, "without a copy"),
                                 ({"stream": 0}, "0 is ambiguous")]:
                    try:
                        x.__dlpack__(**kw)
                    except BufferError as e:
                        assert text in str(e), (kw, e)
                    else:
                        raise AssertionError(f"{kw} was not refused")
                del x, batch
                continue
            t = tensor(capsule).contents.dl_tensor
            assert (t.device.device_type, t.device.device_id) == (2, 0)
            got = device_bytes(t.data, want.nbytes).reshape(want.shape)
            assert np.array_equal(got, want), f"batch {i}"
            del t, capsule, x, batch
        print("child passed")
    """)


def test_an_epoch_timer_counts_stokeholds_own_copies(emulator: Path) -> None:
    run_child(emulator, """
        # The copies run on stokehold's stream, overlapped with the step: no host timer
        # sees them, so the row's copy time is their device time, and no stall.
        loader = stokehold.Loader(sys.argv[1], batch_size=100, device="cuda")
        report = stokehold.TrainReport(loader)
        for e in range(2):
            timer = stokehold.EpochTimer(loader.epoch(e))
            for batch in timer:
                timer.step(batch.synchronize)
                timer.record(0.0, 0, len(batch))
            row = timer.finish()
            assert 0 < row["copy_s"] < row["wall_s"], row
            assert row["stall_copy_s"] == 0, row
            report.push(row)
        assert all(r["copy_s"] > 0 for r in report.json()["epochs"])
        print("child passed")
    """)


def test_the_device_augments_as_the_workers_do(emulator: Path) -> None:
    run_child(emulator, """
        aug = stokehold.Augment("x", crop=2, flip=True, mean=0.3, std=0.2, fill=3, seed=5)
        on_gpu = stokehold.Loader(sys.argv[1], batch_size=100, seed=3, workers=2,
                                  device="cuda", augment=aug)
        on_cpu = stokehold.Loader(sys.argv[1], batch_size=100, seed=3, workers=2, augment=aug)
        assert on_gpu.columns == on_cpu.columns
        assert on_gpu.columns["x"] == (np.dtype(np.float32), (8, 8))
        for epoch in range(2):
            compared = 0
            for batch, want in zip(on_gpu.epoch(epoch), on_cpu.epoch(epoch)):
                compared += 1
                assert np.array_equal(batch.indices, want.indices)
                for name in ("x", "y"):
                    got = device_array(batch, name, want[name])
                    assert np.array_equal(got, want[name]), f"epoch {epoch}: {name} differs"
            assert compared == 18, compared
        print("child passed")
    """)


def test_the_device_cache_serves_later_epochs_as_the_files_do(emulator: Path) -> None:
    run_child(emulator, """
        import json, warnings
        raw = stokehold.Loader(sys.argv[1], batch_size=100)
        row = sum(d.itemsize * int(np.prod(s)) for d, s in raw.columns.values())
        aug = stokehold.Augment("x", crop=2, flip=True, mean=0.3, std=0.2, seed=5)
        import shutil, tempfile
        for augment in (None, aug):
            # The GPU's loader reads a copy of the files, which is overwritten once the
            # cache is filled: later epochs must still serve the rows as they were.
            copy = shutil.copytree(sys.argv[1], tempfile.mkdtemp() + "/digits")
            on_gpu = stokehold.Loader(copy, batch_size=100, seed=3, workers=2,
                                      device="cuda", augment=augment, device_cache=True)
            on_cpu = stokehold.Loader(sys.argv[1], batch_size=100, seed=3, workers=2,
                                      augment=augment)
            # The raw rows, before the augmentation.
            assert on_gpu.device_cache_bytes == 1797 * row, on_gpu.device_cache_bytes
            state = None
            for epoch in range(4):
                filled = on_gpu.device_cache_filled
                assert filled == (epoch > 0), (epoch, filled)
                mine, want = on_gpu.epoch(epoch), on_cpu.epoch(epoch)
                if epoch == 3:
                    # Three batches taken, then a resume from the saved state.
                    for _ in range(3):
                        next(mine), next(want)
                    state = mine.state_dict()
                    on_gpu.load_state_dict(json.loads(json.dumps(state)))
                    mine = on_gpu.epoch(3)
                assert mine.stats()["device_cache"] == filled
                compared = 0
                for batch, expected in zip(mine, want):
                    compared += 1
                    assert np.array_equal(batch.indices, expected.indices)
                    for name in ("x", "y"):
                        e = expected[name]
                        got = device_array(batch, name, e)
                        assert np.array_equal(got, e), f"epoch {epoch}: {name} differs"
                assert compared == len(mine) == (15 if epoch == 3 else 18), (epoch, compared)
                assert on_gpu.device_cache_filled
                if epoch == 0:
                    x = np.load(copy + "/x.npy", mmap_mode="r+")
                    x[:] = 255
                    x.flush()
                    del x
            assert on_gpu.state_dict()["epoch"] == 4
        # What cannot have a cache is refused, naming why; what does not fit runs
        # without one, saying so.
        raises(lambda: stokehold.Loader(sys.argv[1], device_cache=True), 'device="cuda"')
        raises(lambda: stokehold.Loader(sys.argv[1], device="cuda", device_cache=True,
                                        rank=0, world_size=2), "rank 0 of 2")
        raises(lambda: stokehold.Loader(sys.argv[1], batch_size=100, drop_last=True,
                                        device="cuda", device_cache=True), "drop_last")
        tokens = tempfile.mkdtemp() + "/tokens.bin"
        np.arange(5000, dtype=np.uint16).tofile(tokens)
        raises(lambda: stokehold.TokenLoader(tokens, seq_len=16, device="cuda",
                                             device_cache=True), "change every epoch")
        same = stokehold.TokenLoader(tokens, seq_len=16, windows="consecutive",
                                     device="cuda", device_cache=True)
        windows = sum(len(b) for b in same.epoch(0))
        assert same.device_cache_bytes == windows * 17 * 2, (same.device_cache_bytes, windows)
        for bad in (0, 1.5, -1):
            try:
                stokehold.Loader(sys.argv[1], device="cuda", device_cache=bad)
            except ValueError as e:
                assert "share" in str(e), e
            else:
                raise AssertionError(f"device_cache={bad} accepted")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            small = stokehold.Loader(sys.argv[1], device="cuda", device_cache=1e-12)
        assert small.device_cache_bytes is None
        assert any("do not fit" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert sum(len(b) for b in small.epoch(0)) == 1797
        print("child passed")
    """)


def test_documents_and_packed_windows_are_device_cached_too(emulator: Path) -> None:
    run_child(emulator, """
        import shutil, tempfile
        from pathlib import Path
        fixtures = Path(sys.argv[1]).parents[1] / "tests" / "fixtures" / "npy"

        def copy_of_megatron():
            d = Path(tempfile.mkdtemp())
            for ext in ("bin", "idx"):
                shutil.copy(fixtures / f"megatron_u16.{ext}", d / f"megatron_u16.{ext}")
            return d / "megatron_u16"

        def check(make, columns):
            # The GPU's loader reads a copy whose tokens are overwritten once the cache
            # is filled: later epochs must serve the documents as they were.
            copy = copy_of_megatron()
            on_gpu = make(copy, device="cuda", device_cache=True)
            on_cpu = make(fixtures / "megatron_u16")
            assert on_gpu.device_cache_bytes is not None
            for epoch in range(3):
                assert on_gpu.device_cache_filled == (epoch > 0), epoch
                mine, want = on_gpu.epoch(epoch), on_cpu.epoch(epoch)
                assert mine.stats()["device_cache"] == (epoch > 0)
                compared = 0
                for batch, expected in zip(mine, want):
                    compared += 1
                    assert np.array_equal(batch.indices, expected.indices)
                    for name in columns:
                        e = expected[name]
                        got = device_array(batch, name, e)
                        assert np.array_equal(got, e), f"epoch {epoch}: {name} differs"
                assert compared == len(on_cpu), (epoch, compared)
                if epoch == 0:
                    bin = Path(str(copy) + ".bin")
                    bin.write_bytes(bytes([255]) * bin.stat().st_size)

        # Documents, padded, in a length-grouped order: 6 documents of up to 40 tokens.
        check(lambda p, **kw: stokehold.DocumentLoader(p, max_len=16, batch_size=4, seed=2,
                                                       shuffle="grouped", group=4, **kw),
              ("tokens", "len"))
        # Packed windows cut in order, shuffled.
        check(lambda p, **kw: stokehold.PackedLoader(p, seq_len=7, batch_size=3, seed=2,
                                                     windows="consecutive", **kw),
              ("tokens", "positions"))
        # Windows that change every epoch are refused, naming why.
        for kw in ({"windows": "random"}, {"windows": "consecutive", "shuffle_documents": True}):
            raises(lambda: stokehold.PackedLoader(copy_of_megatron(), seq_len=7, device="cuda",
                                                  device_cache=True, **kw), "change every epoch")
        print("child passed")
    """)


def test_device_cuda_without_a_driver_says_why() -> None:
    # This process has no emulator on its path: where no real driver is either, the
    # loader refuses with the reason (where one is, it builds).
    try:
        loader = stokehold.Loader(DIGITS, batch_size=100, device="cuda")
    except stokehold.Error as e:
        assert "device=\"cuda\"" in str(e) and ("libcuda" in str(e) or "CUDA" in str(e)), e
    else:
        # A driver here: the batches are on the device, never host batches in their place.
        assert len(loader) == 18
        assert isinstance(next(iter(loader.epoch(0))), stokehold.DeviceBatch)
    with pytest.raises(ValueError, match="cuda:N"):
        stokehold.Loader(DIGITS, device="gpu")


def torch_on_a_gpu():
    """PyTorch, where it sees a GPU; the test is skipped otherwise (failed under
    STOKEHOLD_REQUIRE_GPU=1, where a GPU run must not pass by skipping)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        if REQUIRE_GPU:
            pytest.fail("STOKEHOLD_REQUIRE_GPU=1 but torch sees no GPU")
        pytest.skip("no GPU")
    return torch


def test_torch_reads_device_batches_on_a_gpu() -> None:
    torch = torch_on_a_gpu()
    x_file = np.load(DIGITS / "x.npy")
    loader = stokehold.Loader(DIGITS, batch_size=100, seed=1, device="cuda", held=1)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for batch in loader.epoch(0):
            x = torch.from_dlpack(batch["x"])
            assert x.is_cuda and x.shape == (len(batch), 8, 8) and x.dtype == torch.uint8
            # Used at once on the consumer's stream, then released with the batch.
            total = x.to(torch.int64).sum()
            expected = int(x_file[batch.indices].astype(np.int64).sum())
            del x, batch
            assert int(total) == expected


def test_torch_reads_augmented_device_batches_on_a_gpu() -> None:
    torch = torch_on_a_gpu()
    aug = stokehold.Augment("x", crop=2, flip=True, mean=0.3, std=0.2, seed=1)
    on_gpu = stokehold.Loader(DIGITS, batch_size=100, seed=1, device="cuda", augment=aug)
    on_cpu = stokehold.Loader(DIGITS, batch_size=100, seed=1, augment=aug)
    for batch, want in zip(on_gpu.epoch(0), on_cpu.epoch(0)):
        x = torch.from_dlpack(batch["x"])
        assert x.is_cuda and x.dtype == torch.float32 and x.shape == (len(batch), 8, 8)
        assert torch.equal(x.cpu(), torch.from_numpy(want["x"].copy()))
        del x, batch


def test_torch_reads_device_cached_batches_on_a_gpu() -> None:
    torch = torch_on_a_gpu()
    aug = stokehold.Augment("x", crop=2, flip=True, mean=0.3, std=0.2, seed=1)
    on_gpu = stokehold.Loader(DIGITS, batch_size=100, seed=1, device="cuda", augment=aug,
                              device_cache=True)
    on_cpu = stokehold.Loader(DIGITS, batch_size=100, seed=1, augment=aug)
    for epoch in range(3):
        mine = on_gpu.epoch(epoch)
        assert mine.stats()["device_cache"] == (epoch > 0)
        for batch, want in zip(mine, on_cpu.epoch(epoch)):
            for name in ("x", "y"):
                t = torch.from_dlpack(batch[name])
                assert t.is_cuda
                assert torch.equal(t.cpu(), torch.from_numpy(want[name].copy())), (epoch, name)
                # The consumer writes in place: the cache keeps the rows as they were.
                t.zero_()
                del t
            del batch
        assert on_gpu.device_cache_filled
