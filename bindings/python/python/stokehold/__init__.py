"""stokehold: a loader that keeps a GPU fed, from Python.

Batches are dict-like (``batch["x"]``, ``keys()``, ``items()``, ``in``) over NumPy arrays
that view the loader's own host buffers (no copy);
``torch.from_dlpack(batch["x"])`` and ``jax.dlpack.from_dlpack`` share that memory too.
A buffer goes back to the loader when its batch and every array viewing it are gone.

    import stokehold
    loader = stokehold.Loader("data/cifar", batch_size=256, shuffle="full", seed=0, workers=2)
    for batch in loader.epoch(0):
        x, y = batch["x"], batch["y"]          # (256, 3, 32, 32) uint8, (256,) int64
    state = loader.state_dict()                # mid-epoch too: resume exactly
"""

from __future__ import annotations

import json
import operator
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _stokehold
from ._stokehold import Error, __version__

# Named where users import it from, so that an error pickles (multiprocessing, Ray).
Error.__module__ = "stokehold"
# A failed CUDA driver call sets both on the error it raises: the driver's code
# (CUresult: 700 is CUDA_ERROR_ILLEGAL_ADDRESS) and whether the CUDA context is lost (a
# fault on the device: every later call in this process fails, PyTorch's too; save the
# loader's state_dict() and resume in a new process).
Error.cuda_code = None
Error.context_lost = False

__all__ = [
    "Augment",
    "Batch",
    "DeviceBatch",
    "DocumentLoader",
    "Epoch",
    "EpochRow",
    "EpochTimer",
    "Error",
    "Loader",
    "MixLoader",
    "PackedLoader",
    "TokenLoader",
    "TrainReport",
    "__version__",
]

PathLike = Union[str, "os.PathLike[str]"]


def _not_shared(kind: str) -> TypeError:
    """What pickling or copying a loader or an epoch raises: they own threads and
    buffers of this process."""
    return TypeError(
        f"a stokehold {kind} cannot be pickled or copied: it owns this process's worker "
        "threads and buffers; build one in each process from the path and options (and "
        "load_state_dict() to carry its position)")


def _device(device: Any) -> Optional[str]:
    """``device`` as the loader takes it: ``None``, ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"``, from a string, an int (a CUDA ordinal) or a ``torch.device``."""
    if device is None or isinstance(device, str):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    if type(device).__name__ == "device":  # torch.device: "cuda", "cuda:1", "cpu"
        return str(device)
    raise TypeError(f"device is 'cpu', 'cuda', 'cuda:N', an int or a torch.device, "
                    f"not {type(device).__name__}")


def _count(name: str, value: Any) -> Any:
    """``value`` as an integer from 0 to 2**64 - 1 (``None`` stays ``None``): what the
    loader's counts, sizes, seeds and epochs are. ``TypeError`` or ``ValueError``
    naming ``name`` otherwise (a negative int would reach Rust as an ``OverflowError``
    that names nothing)."""
    if value is None:
        return None
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} is an integer, not {type(value).__name__}") from None
    if not 0 <= v < 2**64:
        raise ValueError(f"{name}={v}: an integer from 0 to 2**64 - 1")
    return v


class _Columns:
    """What host and device batches share: the column names, the length, the samples,
    the epoch and the batch's number in it. ``batch[name]`` is left to each."""

    __slots__ = ("_raw", "_columns", "_cache")

    def __init__(self, raw: Any, columns: Dict[str, Tuple[np.dtype, Tuple[int, ...]]]):
        self._raw = raw
        self._columns = columns
        self._cache: Dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        array = self._cache.get(name)
        if array is None:
            if name not in self._columns:
                raise KeyError(f"no column {name!r}; the columns are {list(self._columns)}")
            array = self._column(name)
            self._cache[name] = array
        return array

    def _column(self, name: str) -> Any:
        raise NotImplementedError

    def keys(self) -> List[str]:
        """The column names, in the loader's order."""
        return list(self._columns)

    def items(self) -> Iterator[Tuple[str, Any]]:
        """``(name, column)`` pairs, in the loader's order."""
        return ((name, self[name]) for name in self._columns)

    def __reduce__(self) -> Any:
        # Pickled (a multiprocessing queue, Ray), the arrays would have to be copied: the
        # batch views this process's buffers, which another process does not have.
        raise TypeError(
            f"a stokehold {type(self).__name__} views this process's buffers and cannot be "
            "pickled; send {name: np.array(batch[name]) for name in batch} (a copy) instead")

    def __contains__(self, name: object) -> bool:
        return name in self._columns

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def indices(self) -> np.ndarray:
        """The samples of the batch (global indices, NumPy ``uint64`` on the host)."""
        return self._raw.indices

    @property
    def epoch(self) -> int:
        """The epoch the batch belongs to."""
        return self._raw.epoch

    @property
    def number(self) -> int:
        """The batch's number in its epoch."""
        return self._raw.number

    def __repr__(self) -> str:
        cols = ", ".join(f"{n}: {d}{list(s)}" for n, (d, s) in self._columns.items())
        kind = type(self).__name__
        return f"<stokehold.{kind} epoch {self.epoch} #{self.number}, {len(self)} samples: {cols}>"


class Batch(_Columns):
    """One batch: ``batch[name]`` is column ``name`` (a file stem, ``"x"`` for ``x.npy``)
    as a NumPy array of shape ``(len(batch), *sample_shape)``, viewing the loader's
    buffer. ``batch.indices`` are the samples (``uint64``, read-only). The columns'
    arrays are writeable (as DLPack consumers need); the buffer is the batch's own
    until it returns to the pool, and writing it changes no file."""

    __slots__ = ()

    def _column(self, name: str) -> np.ndarray:
        dtype, shape = self._columns[name]
        return self._raw.raw(name).view(dtype).reshape((len(self._raw),) + shape)


class DeviceBatch(_Columns):
    """One batch on a CUDA device (a loader built with ``device="cuda"``): ``batch[name]``
    is column ``name`` in device memory, an array exporting DLPack, so that
    ``torch.from_dlpack(batch["x"])`` is a CUDA tensor of shape
    ``(len(batch), *sample_shape)`` without a copy, as are ``jax.dlpack.from_dlpack`` and
    ``cupy.from_dlpack``. The consumer's stream (the one it names to ``__dlpack__``,
    PyTorch's current stream) waits for the batch's copy on the device, so the tensor
    is safe to use at once; the device slot is copied into again only after that stream
    has run what was enqueued on it before the batch and every tensor made from it
    were freed. ``batch.indices`` are on the host (NumPy ``uint64``)."""

    __slots__ = ()

    def _column(self, name: str) -> Any:
        return self._raw.column(name)

    @property
    def slot(self) -> int:
        """The device slot the batch was copied into."""
        return self._raw.slot

    def synchronize(self) -> None:
        """Waits on the host for the batch's copy (for code that names no stream)."""
        self._raw.synchronize()


class Epoch:
    """One epoch's batches, in order (an iterator). Starting another epoch of the same
    loader, or resuming it, ends this one."""

    __slots__ = ("_raw", "_loader", "_done", "_timed")

    def __init__(self, raw: Any, loader: "Loader"):
        self._raw = raw
        self._loader = loader
        # Whether it yielded its last batch; whether an EpochTimer times it.
        self._done = False
        self._timed = False

    def __iter__(self) -> "Epoch":
        return self

    def __next__(self) -> Union[Batch, DeviceBatch]:
        try:
            raw = self._raw.__next__()
        except StopIteration:
            self._done = True
            raise
        if raw is None:
            self._done = True
            raise StopIteration
        if self._loader._device is not None:
            return DeviceBatch(raw, self._loader._columns)
        return Batch(raw, self._loader._columns)

    def __len__(self) -> int:
        """Batches this epoch yields in all: from its first, or, resumed, from the
        batch after the saved one."""
        return len(self._raw)

    def __reduce__(self) -> Any:
        raise _not_shared("epoch")

    def stats(self) -> Dict[str, Any]:
        """The loader's figures of this epoch so far: batches, samples, gather_s,
        waited_s, stalls, first_batch_s, storage (warm, warming, streaming),
        bytes_read (None where the kernel does not count the process's reads), and
        device_cache (whether the batches are gathered from the device
        cache, the loader computing their indices only)."""
        return self._raw.stats()

    def state_dict(self) -> Dict[str, int]:
        """The loader's state (see ``Loader.state_dict``)."""
        return self._loader.state_dict()


class Augment:
    """A random crop, a horizontal flip and a per-channel normalisation of a ``uint8``
    image column, drawn for each sample from ``(seed, epoch, sample)``: the same
    whatever the workers, after a resume, and on the CPU or the GPU. Give it to
    ``Loader(..., augment=...)``.

    ``crop`` pads each side by that many pixels of value ``fill`` and cuts the image back
    to its size at a random offset (torchvision's ``RandomCrop(size, padding=crop)``);
    ``flip`` mirrors it left to right with probability one half
    (``RandomHorizontalFlip``); ``mean`` and ``std`` (one value, or one a channel, on
    the 0-1 scale) make the column ``float32``, ``(v / 255 - mean) / std``
    (``ToTensor`` then ``Normalize``). Images are ``(channels, height, width)`` or
    ``(height, width)`` a sample; ``(height, width, channels)`` with
    ``channels_last=True``. The loader's workers augment each batch as they gather it;
    with ``device="cuda"``, the raw bytes are copied and the GPU augments them.

        augment = stokehold.Augment("x", crop=4, flip=True,
                                    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))
    """

    def __init__(
        self,
        column: str = "x",
        crop: int = 0,
        flip: bool = False,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        fill: int = 0,
        channels_last: bool = False,
        seed: int = 0,
    ):
        if (mean is None) != (std is None):
            raise ValueError("mean and std go together")
        if not 0 <= int(crop) <= _stokehold._AUGMENT_MAX_PAD:
            raise ValueError(f"crop pads by 0 to {_stokehold._AUGMENT_MAX_PAD} pixels, not {crop}")
        if not 0 <= int(fill) <= 255:
            raise ValueError(f"fill is a uint8 pixel value, 0 to 255, not {fill}")
        if not 0 <= int(seed) < 2**64:
            raise ValueError(f"seed is an unsigned 64-bit integer, not {seed}")
        as_list = lambda v: None if v is None else [float(x) for x in np.atleast_1d(v)]
        self.column, self.crop, self.flip = str(column), int(crop), bool(flip)
        self.mean, self.std = as_list(mean), as_list(std)
        self.fill, self.channels_last, self.seed = int(fill), bool(channels_last), int(seed)

    def _args(self) -> Tuple[Any, ...]:
        return (self.column, self.seed, self.crop, self.flip, self.fill,
                self.channels_last, self.mean, self.std)

    def draws(self, epoch: int, indices: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The draws of samples ``indices`` of ``epoch``: ``(dy, dx, flip)``, where output
        pixel ``(y, x)`` is input pixel ``(y + dy, x' + dx)``, ``x' = width - 1 - x`` where
        ``flip`` and ``x`` otherwise (``fill`` outside the image)."""
        positions = [int(i) for i in np.asarray(indices, dtype=np.uint64).ravel()]
        return _stokehold._augment_draws(self._args(), _count("epoch", epoch), positions)

    def __repr__(self) -> str:
        norm = "" if self.mean is None else f", mean={self.mean}, std={self.std}"
        return (f"Augment({self.column!r}, crop={self.crop}, flip={self.flip}{norm}, "
                f"fill={self.fill}, channels_last={self.channels_last}, seed={self.seed})")


class Loader:
    """A prefetching, shuffling, multi-threaded loader over ``.npy`` columns.

    ``path`` is a directory (every ``.npy`` in it becomes a column named by its stem,
    ``x`` and ``y`` first), or give ``columns``, a list of ``.npy`` paths.
    ``shuffle`` is ``"full"``, ``"block"`` or ``"none"`` (``"grouped"``, by length, is
    for ``DocumentLoader``). ``workers`` defaults to the available CPUs, at most 8 (a
    process per GPU on an 8-GPU node may want fewer); ``prefetch`` (batches assembled
    ahead) to about 32 MiB of batches, at least ``2 * workers`` and at most 64.
    ``rank``/``world_size``
    default from torchrun, Slurm or Open MPI variables (only rank 0 then draws the
    progress bar, unless ``progress`` says otherwise). ``held`` is how many batches
    the loop may keep alive at once beyond the prefetched ones (default 2): a loop that
    keeps more (a list, a queue) needs a larger ``held``, or the loader reports that
    every buffer is held. ``progress`` draws a per-epoch bar on stderr (default: when
    stderr is a terminal).

    ``page_cache_budget`` is how many bytes of page cache the loader may fill with the
    files (default: half the available memory, or of a memory cgroup's room where
    that is less); larger files stream straight from
    storage, with ``O_DIRECT`` unless ``direct_reads=False`` (for a file system where
    direct reads are slow), which streams them through the page cache instead.

    ``device="cuda"`` (or ``"cuda:N"``, an int, a ``torch.device``; a bare ``"cuda"`` is
    the calling thread's current device, PyTorch's once it has used CUDA, else
    ``LOCAL_RANK``'s under torchrun, else 0) gathers batches into page-locked memory and
    copies each to the GPU on stokehold's own stream: the epoch yields ``DeviceBatch``es,
    whose columns export DLPack (``torch.from_dlpack``) without a copy. The device holds
    ``held + 2`` batch slots (the batches a loop keeps, the one it works on and the one
    being copied); a loop that keeps all ``held + 2`` alive and asks for another gets
    ``stokehold.Error`` (after a second) instead of waiting forever, unless a batch it
    keeps is in use on another thread, which is waited for. The batch it asked for
    stays in the epoch: once it lets one go, the epoch goes on from there. Without a
    usable CUDA driver and device, ``device="cuda"`` raises ``stokehold.Error`` saying
    why.

    ``augment`` (an ``Augment``) crops, flips and normalises an image column.

    ``device_cache=True`` (with ``device="cuda"``) keeps the dataset on the GPU, within
    half its free memory (a float in (0, 1] sets another share): the batches of the
    epochs that fill it are scattered there as they are copied, raw (before
    ``augment``), and once every sample is there each later epoch gathers its batches
    on the GPU, augmented there, with no host gathering and no copy but the indices.
    Order, ``state_dict`` and resume are the same. A dataset too large for its share
    runs without (a ``RuntimeWarning`` says so); a loader whose epochs leave samples
    out (``rank``/``world_size``, ``drop_last``) or change them (random token windows)
    raises ``stokehold.Error``. ``device_cache_bytes`` and ``Epoch.stats()["device_cache"]``
    say what it does.

    Raises ``stokehold.Error`` naming the file and the problem for bad input.
    """

    def __init__(
        self,
        path: Optional[PathLike] = None,
        batch_size: int = 256,
        *,
        shuffle: str = "full",
        seed: int = 0,
        workers: Optional[int] = None,
        drop_last: bool = False,
        prefetch: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        columns: Optional[Sequence[PathLike]] = None,
        page_cache_budget: Optional[int] = None,
        held: Optional[int] = None,
        progress: Optional[bool] = None,
        device: Union[None, str, int, Any] = None,
        direct_reads: bool = True,
        augment: Optional[Augment] = None,
        device_cache: Union[bool, float] = False,
    ):
        cols = None if columns is None else [str(c) for c in columns]
        if augment is not None and not isinstance(augment, Augment):
            raise TypeError(f"augment is a stokehold.Augment, not {type(augment).__name__}")
        dataset = _stokehold._Dataset.npy(None if path is None else str(path), cols)
        self._build(
            dataset, batch_size, shuffle, seed, workers, drop_last, prefetch, held,
            rank, world_size, page_cache_budget, progress, device,
            direct_reads=direct_reads, augment=augment, device_cache=device_cache,
        )

    def _build(self, dataset: Any, batch_size: int, shuffle: str, seed: int,
               workers: Optional[int], drop_last: bool, prefetch: Optional[int],
               held: Optional[int], rank: Optional[int], world_size: Optional[int],
               page_cache_budget: Optional[int], progress: Optional[bool],
               device: Any, direct_reads: bool = True,
               group: Optional[int] = None, augment: Optional[Augment] = None,
               device_cache: Union[bool, float] = False) -> None:
        device = _device(device)
        self._closed = False
        self._dataset = dataset
        options = (
            _count("batch_size", batch_size), shuffle, _count("seed", seed),
            _count("workers", workers), drop_last, _count("prefetch", prefetch),
            _count("held", held), _count("rank", rank), _count("world_size", world_size),
            _count("page_cache_budget", page_cache_budget), progress, device,
        )
        group = _count("group", group)
        args = None if augment is None else augment._args()
        share = _cache_share(device_cache)
        self._start = lambda: _stokehold._Loader(
            dataset, *options, direct_reads=direct_reads, group=group, augment=args,
            device_cache=share)
        self._running: Any = self._start()
        self._used = False
        self._next = 0
        self._device = None if device in (None, "cpu") else device
        self._columns = {
            name: (np.dtype(descr), tuple(int(d) for d in shape))
            for name, descr, shape in self._raw.columns()
        }

    @property
    def _raw(self) -> Any:
        """The Rust loader: its buffers and threads, started again if given back."""
        if self._running is None:
            if self._closed:
                raise Error("this loader was closed")
            self._running = self._start()
        return self._running

    def close(self) -> None:
        """Ends the running epoch and frees the loader's threads and buffers (and, with
        ``device="cuda"``, its page-locked memory and device slots) now, rather than
        when the loader is collected. Batches still held keep their own buffers until
        they go. A closed loader raises ``stokehold.Error`` when used; ``with
        stokehold.Loader(...) as loader:`` closes it at the block's end."""
        self._closed = True
        self._running = None

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise _not_shared("loader")

    def _give_back(self) -> None:
        """Frees the buffers and threads of a loader never iterated nor resumed (a
        ``MixLoader``'s source, whose dataset is all the mix uses); a later use starts
        them again, as at construction."""
        if not self._used:
            self._running = None

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return len(self._raw)

    @property
    def columns(self) -> Dict[str, Tuple[np.dtype, Tuple[int, ...]]]:
        """Column name -> (dtype, shape of one sample)."""
        return dict(self._columns)

    @property
    def device_cache_bytes(self) -> Optional[int]:
        """Bytes of GPU memory the device cache takes (``device_cache``), or ``None``
        without one."""
        return self._raw.device_cache_bytes()

    @property
    def device_cache_filled(self) -> bool:
        """Whether the device cache holds every sample: epochs started from now on
        gather their batches on the GPU."""
        return self._raw.device_cache_filled()

    def epoch(self, epoch: int) -> Epoch:
        """The batches of ``epoch``, in order: a pure function of the seed, the epoch
        and the shard. After ``load_state_dict``, the saved epoch yields only the batches
        after the saved one."""
        epoch = _count("epoch", epoch)
        self._used = True
        running = Epoch(self._raw.epoch(epoch), self)
        self._next = epoch + 1
        return running

    def __iter__(self) -> Iterator[Union[Batch, DeviceBatch]]:
        """The batches of the next epoch, so that ``for batch in loader`` inside a loop
        over epochs (or a framework that calls ``iter(loader)`` once an epoch, as PyTorch
        Lightning does) walks them in turn: epoch 0 first, then the one after the last
        epoch started (an epoch left early is not begun again), or the epoch a loaded
        state resumes, or the one given to ``set_epoch``. The epoch starts at the first
        batch asked for: an iterator made and never used (Lightning's check that the
        loader is iterable) starts none.

        An epoch that ends by an exception while a batch is awaited (Ctrl-C's
        ``KeyboardInterrupt``, a failed read) is not left behind: the next
        ``iter(loader)`` goes on with it, from the batch it was waiting for."""
        epoch = self._next
        try:
            yield from self.epoch(epoch)
        except GeneratorExit:
            # Closed by the loop (a break): the epoch is left, as documented.
            raise
        except BaseException:
            if not self._closed:
                state = self.state_dict()
                if state["epoch"] == epoch:
                    self.load_state_dict(state)
                    self._next = epoch
            raise

    def set_epoch(self, epoch: int) -> None:
        """Makes ``epoch`` the one ``iter(loader)`` runs next (as
        ``DistributedSampler.set_epoch`` does for a ``DataLoader``)."""
        self._next = _count("epoch", epoch)

    def state_dict(self) -> Dict[str, int]:
        """Where the loader is, as a plain JSON-serialisable dict: ``epoch``, ``batch``
        (batches consumed) and ``order`` (a fingerprint of the configuration), and for
        elastic resumes ``start``, ``taken`` (positions of the epoch's global order taken
        before the first batch, and once every rank has had ``batch`` batches) and
        ``global`` (a fingerprint of the data, shuffle and seed)."""
        return json.loads(self._raw.state_json())

    def load_state_dict(self, state: Dict[str, int], elastic: bool = False) -> None:
        """Resume: the next ``epoch(e)`` for the saved epoch yields exactly the rest of
        it. A state from a differently configured loader raises ``stokehold.Error``.

        With ``elastic=True`` the state may come from a loader with another world
        size, rank, batch size or ``drop_last`` (after a job restarts on more or fewer
        GPUs, say; any rank's state, saved when every rank had taken the same number of
        batches): the saved epoch then yields this rank's share of the samples the old
        ranks had not taken, and the new ranks together take each of them once. Only
        another dataset, shuffle or seed raises."""
        if not isinstance(state, dict):
            raise TypeError(f"a loader state is a dict, not {type(state).__name__}")
        if "order" not in state:
            # Left out (or misspelt), it would read as 0: resumed without the check.
            raise Error(
                "a loader state needs its 'order' key, the fingerprint of the loader that "
                "saved it (state_dict() has it; 'order': 0 resumes without the check)")
        try:
            # Integers however they came back (numpy's, a tensor's item()): exact, as
            # the fingerprints need every one of their 64 bits.
            state = {k: operator.index(v) for k, v in state.items()}
        except TypeError as e:
            raise Error(f"a loader state holds integers only: {e}") from None
        self._used = True
        self._raw.resume_json(json.dumps(state), elastic)
        self._next = state.get("epoch", 0)

    def info(self) -> Dict[str, Any]:
        """What the loader runs with: workers, prefetch, buffers, pool_bytes,
        page_cache_budget, direct_reads (as built: the running epoch goes on)."""
        return self._raw.info()


class TokenLoader(Loader):
    """A loader over a token file: an llm.c / modded-nanogpt ``.bin`` (header and
    ``uint16`` or ``uint32`` tokens), a raw stream of ``dtype`` tokens (``"uint16"`` by
    default), or a 1-d ``.npy``; or over a LitData dataset optimized with its
    ``TokensLoader``, as litgpt prepares pretraining data (``path`` its directory or
    its ``index.json``), each chunk cut on its own (no window crosses two chunks, as
    none of LitData's blocks does; consecutive windows share a token, LitData's blocks
    do not). Each sample is a window of ``seq_len + 1`` tokens (inputs and shifted
    targets), the column ``"tokens"``. ``windows="random"`` starts each window at a
    random offset per epoch (from ``seed``); ``"consecutive"`` cuts the stream in order.
    The token type of an llm.c file, a ``.npy`` or a LitData set is the file's own
    (``dtype``, if given, must agree). ``device_cache`` is as for ``Loader``, with
    ``windows="consecutive"`` (random windows change every epoch)."""

    def __init__(
        self,
        path: PathLike,
        seq_len: int,
        batch_size: int = 32,
        *,
        windows: str = "random",
        seed: int = 0,
        dtype: Optional[str] = None,
        shuffle: str = "full",
        workers: Optional[int] = None,
        drop_last: bool = False,
        prefetch: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        page_cache_budget: Optional[int] = None,
        held: Optional[int] = None,
        progress: Optional[bool] = None,
        device: Union[None, str, int, Any] = None,
        direct_reads: bool = True,
        device_cache: Union[bool, float] = False,
    ):
        dataset = _stokehold._Dataset.tokens(
            str(path), _count("seq_len", seq_len), windows, _count("seed", seed), dtype)
        self._build(
            dataset, batch_size, shuffle, seed, workers, drop_last, prefetch, held,
            rank, world_size, page_cache_budget, progress, device,
            direct_reads=direct_reads, device_cache=device_cache,
        )



def _cache_share(device_cache: Union[bool, float, None]) -> Optional[float]:
    """The share of the GPU's free memory ``device_cache`` asks for: ``None`` for no
    cache, half for ``True``."""
    if device_cache is None or device_cache is False:
        return None
    if device_cache is True:
        return 0.5
    if not isinstance(device_cache, (int, float)):
        raise TypeError(f"device_cache is a bool or a float, not {type(device_cache).__name__}")
    return float(device_cache)


def _document_paths(path: Union[PathLike, Sequence[PathLike]]) -> List[str]:
    """The files of a set of documents: a list of paths as given; for a directory that
    ``datasets``' ``save_to_disk`` wrote, its table's shards in order (as its
    ``state.json`` lists them, else its ``data-*.arrow`` files by name); for a MosaicML
    Streaming (MDS) directory, its shards as its ``index.json`` lists them; or the one
    path."""
    if isinstance(path, (list, tuple)):
        return [str(p) for p in path]
    root = Path(path)
    if root.name == "index.json" and root.is_file():
        root = root.parent
    if not root.is_dir():
        return [str(path)]
    state, index = root / "state.json", root / "index.json"
    if state.is_file():
        try:
            files = [root / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise Error(f"{state}: not the state.json of a saved datasets table ({e!r})")
    elif index.is_file():
        files = _mds_shards(index)
    else:
        files = sorted(root.glob("data-*.arrow"))
    if not files:
        raise Error(f"{root}: a directory without a saved table (no state.json, no index.json, "
                    "no data-*.arrow)")
    return [str(f) for f in files]


def _mds_shards(index: Path) -> List[Path]:
    """The shards an MDS ``index.json`` lists, in order, decompressed: a shard kept only
    compressed (its ``zip_data``) is an error naming it, as streaming decompresses it on
    download."""
    try:
        shards = json.loads(index.read_text())["shards"]
        files = [(s["format"], s["raw_data"]["basename"], (s.get("zip_data") or {}).get("basename"))
                 for s in shards]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise Error(f"{index}: not the index.json of an MDS dataset ({e!r})")
    out = []
    for fmt, raw, zipped in files:
        if fmt != "mds":
            raise Error(f"{index}: shard {raw} is in format {fmt!r}, not mds")
        shard = index.parent / raw
        if not shard.is_file() and zipped and (index.parent / zipped).is_file():
            raise Error(f"{index.parent / zipped}: a compressed shard; decompress it to {raw} "
                        "(streaming does so on download)")
        out.append(shard)
    if not out:
        raise Error(f"{index}: an MDS index that lists no shards")
    return out


class DocumentLoader(Loader):
    """A loader over variable-length documents (token sequences of any length), read in
    place: a Megatron-LM / Megatron-Core indexed dataset (``path`` is its prefix, or its
    ``.idx`` or ``.bin``; each sequence is a sample); with ``offsets``, a 1-d
    integer ``.npy`` of tokens at ``path`` and a 1-d integer ``.npy`` of ``n + 1``
    offsets into it (document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``); or an
    Arrow IPC file (``path`` ending in ``.arrow``, as Hugging Face ``datasets`` writes
    its tables: ``save_to_disk``'s ``data-*.arrow``, or its cache), whose list column
    ``column`` (``"input_ids"`` by default) holds a document a row; or a MosaicML
    Streaming shard (``path`` ending in ``.mds``, as ``streaming.MDSWriter`` writes
    it), whose array column ``column`` (``"tokens"`` by default, as LLM Foundry names
    it; encoded ``ndarray:<integer type>``, or a plain ``ndarray`` of integers) holds
    a document a sample. A directory that
    ``save_to_disk`` wrote (its shards as its ``state.json`` lists them), an MDS
    directory (its shards as its ``index.json`` lists them) or a list of paths is one
    set, its shards in order. ``dtype`` is the integer type of an MDS column encoded as
    raw ``bytes`` (``"int64"`` for the token columns older LLM Foundry versions wrote);
    given for an array column, it must be the column's own.

    Each batch has two columns: ``"tokens"``, shape ``(B, max_len)`` in the files' token
    type, each row a document's first ``max_len`` tokens followed by ``pad``; and
    ``"len"``, ``int64``, how many of them are the document's (at most ``max_len``:
    longer documents are served cut). ``batch["len"].max()`` is the batch's longest
    row, to trim the padding off before the model. The other options are
    ``Loader``'s; ``shuffle="grouped"`` sorts runs of ``group`` positions of the shuffled
    order by length (by default 64 training steps: ``64 * batch_size * world_size``), so
    each step's batches hold documents of similar lengths and little padding. The group
    is part of the order: give it to resume elastically on another world size or batch
    size (``load_state_dict(state, elastic=True)``). ``device_cache`` is as for
    ``Loader``: the cache holds each document as its padded row (``max_len`` tokens)."""

    def __init__(
        self,
        path: Union[PathLike, Sequence[PathLike]],
        max_len: int,
        batch_size: int = 32,
        *,
        offsets: Optional[PathLike] = None,
        column: Optional[str] = None,
        pad: int = 0,
        shuffle: str = "full",
        seed: int = 0,
        group: Optional[int] = None,
        workers: Optional[int] = None,
        drop_last: bool = False,
        prefetch: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        page_cache_budget: Optional[int] = None,
        held: Optional[int] = None,
        progress: Optional[bool] = None,
        device: Union[None, str, int, Any] = None,
        direct_reads: bool = True,
        dtype: Optional[str] = None,
        device_cache: Union[bool, float] = False,
    ):
        dataset = _stokehold._Dataset.documents(
            _document_paths(path), _count("max_len", max_len), pad,
            None if offsets is None else str(offsets),
            column, dtype,
        )
        self._build(
            dataset, batch_size, shuffle, seed, workers, drop_last, prefetch, held,
            rank, world_size, page_cache_budget, progress, device,
            direct_reads=direct_reads, group=group, device_cache=device_cache,
        )


class PackedLoader(Loader):
    """A loader over variable-length documents packed for pretraining: the documents
    ``DocumentLoader`` reads (a Megatron / fairseq indexed dataset at ``path``, a
    token ``.npy`` at ``path`` with ``offsets``, an ``.arrow`` file's list ``column``
    or an ``.mds`` shard's array ``column``, or ``bytes`` column of ``dtype``) concatenated in their stored order (with
    ``shuffle_documents=True``, in another order each epoch, drawn from ``seed``, as
    Megatron-LM does, within each file) and
    cut into windows of ``seq_len + 1`` tokens, as ``TokenLoader`` cuts a token file,
    with no padding. Several files (a table's shards) are packed each on its own: no
    window crosses two, each shard's last tokens short of a window are left out, and a
    shard shorter than a window is an error naming it.

    Each batch has two columns of shape ``(B, seq_len + 1)``: ``"tokens"``, in the
    files' token type, and ``"positions"``, ``int32``, each token's position in its own
    document (0 at a document's first token). ``positions[:, :-1]`` are the
    ``position_ids`` of a packed batch (Hugging Face models and FlashAttention's
    variable-length kernels start a sequence at each 0); a target
    ``tokens[:, j + 1]`` lies in another document than its input where
    ``positions[:, j + 1] == 0``. ``windows="random"`` starts each window at a random
    offset per epoch (from ``seed``); ``"consecutive"`` cuts the concatenation in
    order. The other options are ``Loader``'s; ``device_cache`` is as for ``Loader``,
    with ``windows="consecutive"`` and the documents in their stored order (random
    windows and shuffled documents change the windows every epoch)."""

    def __init__(
        self,
        path: Union[PathLike, Sequence[PathLike]],
        seq_len: int,
        batch_size: int = 32,
        *,
        offsets: Optional[PathLike] = None,
        column: Optional[str] = None,
        windows: str = "random",
        seed: int = 0,
        shuffle: str = "full",
        workers: Optional[int] = None,
        drop_last: bool = False,
        prefetch: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        page_cache_budget: Optional[int] = None,
        held: Optional[int] = None,
        progress: Optional[bool] = None,
        device: Union[None, str, int, Any] = None,
        direct_reads: bool = True,
        shuffle_documents: bool = False,
        dtype: Optional[str] = None,
        device_cache: Union[bool, float] = False,
    ):
        dataset = _stokehold._Dataset.packed(
            _document_paths(path), _count("seq_len", seq_len), windows, _count("seed", seed),
            None if offsets is None else str(offsets), column, shuffle_documents, dtype,
        )
        self._build(
            dataset, batch_size, shuffle, seed, workers, drop_last, prefetch, held,
            rank, world_size, page_cache_budget, progress, device,
            direct_reads=direct_reads, device_cache=device_cache,
        )


class MixLoader(Loader):
    """A loader over a mixture: the datasets of ``sources`` (loaders of any kind whose
    batches have the same columns: ``TokenLoader``s of several corpora, say) mixed by
    ``weights``, as Megatron-LM's blended datasets, MosaicML Streaming's stream
    proportions and LitData's ``CombinedStreamingDataset`` mix them. Only the sources'
    data and data options count (path, ``seq_len``, ``windows``...), not their batch
    size, shuffle or workers. A source never iterated gives its buffers and threads
    back (they start again if it is used on its own later).

    Each epoch has ``samples`` samples (by default as many as the sources hold
    together), of which source ``k`` gives its share ``weights[k] / sum(weights)``
    (``takes`` says how many). A source is drawn in shuffled orders of its own: one
    that gives fewer samples an epoch than it holds serves, over the next epochs, all
    of them before any again; one that gives more serves each several times an epoch.
    The draws and the loader's shuffle are pure functions of ``seed``, the epoch and
    the position, so epochs resume exactly (``state_dict``) and shard across ranks.
    ``source(epoch, batch.indices)`` says which source and which of its samples each
    row is (to log each source's loss, say). ``shuffle="full"`` (the default) spreads
    each source over the whole epoch; ``"grouped"`` is refused. The other options are
    ``Loader``'s."""

    def __init__(
        self,
        sources: Sequence[Loader],
        weights: Sequence[float],
        samples: Optional[int] = None,
        batch_size: int = 32,
        *,
        shuffle: str = "full",
        seed: int = 0,
        workers: Optional[int] = None,
        drop_last: bool = False,
        prefetch: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        page_cache_budget: Optional[int] = None,
        held: Optional[int] = None,
        progress: Optional[bool] = None,
        device: Union[None, str, int, Any] = None,
        direct_reads: bool = True,
    ):
        sources = list(sources)
        bad = [type(s).__name__ for s in sources if not isinstance(s, Loader)]
        if bad:
            raise TypeError(f"a mix's sources are stokehold loaders, not {', '.join(bad)}")
        dataset = _stokehold._Dataset.mix(
            [s._dataset for s in sources], [float(w) for w in weights],
            _count("samples", samples), _count("seed", seed),
        )
        for s in sources:
            s._give_back()
        self._build(
            dataset, batch_size, shuffle, seed, workers, drop_last, prefetch, held,
            rank, world_size, page_cache_budget, progress, device,
            direct_reads=direct_reads,
        )

    @property
    def takes(self) -> List[int]:
        """Samples each source gives an epoch, in the order of ``sources``."""
        return self._dataset.takes()

    def source(self, epoch: int, indices: Any) -> Tuple[np.ndarray, np.ndarray]:
        """Which source (``int64``, its place in ``sources``) and which of its samples
        (``uint64``) each of ``indices`` (a batch's ``indices``) is in ``epoch``."""
        given = np.asarray(indices)
        if given.size and given.dtype.kind not in "ui":
            raise TypeError(f"a mix's positions are integers, not {given.dtype}")
        if given.size and given.dtype.kind == "i" and given.min() < 0:
            raise IndexError(f"position {given.min()} of a mix")
        flat = given.astype(np.uint64).ravel()
        parts, samples = self._dataset.sources(_count("epoch", epoch), flat.tolist())
        return np.asarray(parts, dtype=np.int64), np.asarray(samples, dtype=np.uint64)


class EpochTimer:
    """Times one epoch of your loop as ``stokehold train`` times its own: the wait for
    each batch, your copies and your step, the residency of the data, and the loss and
    accuracy you record. ``finish()`` gives the epoch's row for a ``TrainReport``.
    With ``device="cuda"``, the row's copy time also holds stokehold's own copies to the
    device: their time on its copy stream, which overlaps your step (no host timer
    sees it, and it is not counted as a stall).

        report = stokehold.TrainReport(loader)
        for e in range(3):
            timer = stokehold.EpochTimer(loader.epoch(e))
            for batch in timer:
                loss_sum, correct = timer.step(train_step, batch)
                timer.record(loss_sum, correct, len(batch))
            report.push(timer.finish())
        report.print()
    """

    def __init__(self, epoch: Epoch):
        if not isinstance(epoch, Epoch):
            raise TypeError(
                f"EpochTimer times loader.epoch(e), not a {type(epoch).__name__}")
        if epoch._timed:
            raise Error("this epoch already has an EpochTimer: one timer an epoch")
        epoch._timed = True
        self._epoch = epoch
        scan = time.perf_counter()
        self._residency = epoch._loader._raw.residency()
        scan = time.perf_counter() - scan
        self._wait = self._copy = self._compute = 0.0
        self._loss_sum, self._correct, self._samples = 0.0, 0, 0
        self._finished = False
        # From the epoch's own start (its workers may be at work already), the residency
        # scan (the timer's own work) left out.
        self._start = time.perf_counter() - epoch._raw.elapsed() + scan

    def __iter__(self) -> "EpochTimer":
        return self

    def __len__(self) -> int:
        return len(self._epoch)

    def __next__(self) -> Union[Batch, DeviceBatch]:
        return self._timed("_wait", next, self._epoch)

    def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)``, your training step, counted as compute."""
        return self._timed("_compute", fn, *args, **kwargs)

    def copy(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)``, a copy to a device, counted as copy."""
        return self._timed("_copy", fn, *args, **kwargs)

    def _timed(self, counter: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - t)

    def record(self, loss_sum: float, correct: int, samples: int) -> None:
        """Adds a batch's summed loss, its correct predictions and its sample count (a
        loss that is not finite marks the epoch as diverged, as ``stokehold train``
        does)."""
        try:
            correct, samples = operator.index(correct), operator.index(samples)
        except TypeError:
            raise TypeError(
                "correct and samples are counts (integers): the batch's correct "
                f"predictions and its samples, not {type(correct).__name__} and "
                f"{type(samples).__name__}") from None
        if not 0 <= correct <= samples < 2**63:
            raise ValueError(
                f"correct={correct}, samples={samples}: 0 <= correct <= samples")
        self._loss_sum += float(loss_sum)
        self._correct += correct
        self._samples += samples

    def finish(self, partial: bool = False) -> "EpochRow":
        """Ends the epoch (batches not taken go back to the loader) and returns its row.
        The epoch must have yielded its last batch, unless ``partial=True`` (a loop
        that stopped early: its row holds what it took)."""
        if self._finished:
            raise Error("this EpochTimer has finished already: one row an epoch")
        if not (partial or self._epoch._done):
            raise Error(
                "finish() before the epoch's last batch: run it to its end, or pass "
                "partial=True for a row of what the loop took")
        self._finished = True
        wall = time.perf_counter() - self._start
        raw = self._epoch._raw.row(
            wall,
            self._wait,
            self._copy,
            self._compute,
            self._loss_sum,
            self._correct,
            self._samples,
            self._residency,
        )
        return EpochRow(raw, self._epoch._loader)


class EpochRow:
    """One epoch's figures, as a row of ``stokehold train``'s table (what
    ``EpochTimer.finish()`` returns): ``row["wall_s"]``, ``row.as_dict()``, the keys of
    an epoch in ``stokehold train --json``."""

    __slots__ = ("_raw", "_dict", "_loader")

    def __init__(self, raw: Any, loader: "Loader"):
        self._raw = raw
        self._dict = json.loads(raw.json())
        self._loader = loader

    def as_dict(self) -> Dict[str, Any]:
        """The row as a plain dict (a copy)."""
        return dict(self._dict)

    def __getitem__(self, key: str) -> Any:
        """The figure ``key`` (``wall_s``, ``samples_per_s``, ``stall_data_s``...)."""
        return self._dict[key]

    def __repr__(self) -> str:
        return f"<stokehold.EpochRow {self._dict}>"


class TrainReport:
    """The epochs of a loop and why the first was slower: the table and warm-up split of
    ``stokehold train``, and its JSON. ``device`` is a label for the report's
    ``device`` line and key (``"cuda:0"``, ``"H100"``...), nothing more."""

    def __init__(self, loader: Loader, device: str = "python"):
        if not isinstance(loader, Loader):
            raise TypeError(f"TrainReport reports a Loader's epochs, not a {type(loader).__name__}")
        self._raw = loader._raw.report(device)
        self._loader = loader
        self._epochs: set = set()

    def push(self, row: EpochRow) -> None:
        """Adds an epoch's row (``EpochTimer.finish()``): of this report's loader, each
        epoch once."""
        if not isinstance(row, EpochRow):
            raise TypeError(f"push takes an EpochRow (EpochTimer.finish()), not a "
                            f"{type(row).__name__}")
        if row._loader is not self._loader:
            raise ValueError("this row is of another loader than the report's")
        if row["epoch"] in self._epochs:
            raise ValueError(f"epoch {row['epoch']} is in the report already")
        self._epochs.add(row["epoch"])
        self._raw.push(row._raw)

    def table(self) -> str:
        """The epochs' table, as ``stokehold train`` prints it."""
        return self._raw.table()

    def warmup_text(self) -> str:
        """Why the first epoch was slower than the steady ones: the setup costs and the
        split of its excess (empty with fewer than two epochs)."""
        return self._raw.warmup_text()

    def json(self) -> Dict[str, Any]:
        """The report as a dict (the keys of ``stokehold train --json``)."""
        return json.loads(self._raw.json())

    def print(self, file: Any = None) -> None:
        """Prints the table and the warm-up split (to ``file``, default stdout)."""
        print(self.table() + self.warmup_text(), end="", file=file or sys.stdout)

    def __str__(self) -> str:
        return self.table() + self.warmup_text()
