"""Augmentation from Python: each row is its sample cropped, flipped and normalised as
torchvision's RandomCrop(padding), RandomHorizontalFlip, ToTensor and Normalize would,
by the draws ``Augment.draws`` names; the same on any worker count and after a resume;
bad settings raise."""

import json

import numpy as np
import pytest

import stokehold

N = 300
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """x (N, 3, 12, 10) uint8 of pseudo-random bytes, y (N,) int64 the sample's index."""
    d = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    np.save(d / "x.npy", rng.integers(0, 256, size=(N, 3, 12, 10), dtype=np.uint8))
    np.save(d / "y.npy", np.arange(N, dtype=np.int64))
    return d


def reference(img, dy, dx, flip, pad, fill, mean=None, std=None, channels_last=False):
    """The augmented image by NumPy: pad, crop, flip, then normalise (in float64, rounded
    to float32 once, as stokehold's table is)."""
    if channels_last:
        img = img.transpose(2, 0, 1)
    _, h, w = img.shape
    padded = np.pad(img, ((0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    out = padded[:, pad + dy : pad + dy + h, pad + dx : pad + dx + w]
    if flip:
        out = out[:, :, ::-1]
    if mean is not None:
        m = np.asarray(mean, dtype=np.float32).astype(np.float64)[:, None, None]
        s = np.asarray(std, dtype=np.float32).astype(np.float64)[:, None, None]
        out = ((out / 255.0 - m) / s).astype(np.float32)
    if channels_last:
        out = out.transpose(1, 2, 0)
    return out


def rows(loader, epoch, stop=None):
    out = []
    for k, batch in enumerate(loader.epoch(epoch)):
        out += [(int(i), batch["x"][j].copy()) for j, i in enumerate(batch.indices)]
        if stop is not None and k + 1 == stop:
            break
    return out


def test_rows_equal_numpy_augmenting_their_samples(images):
    x = np.load(images / "x.npy")
    aug = stokehold.Augment("x", crop=3, flip=True, mean=MEAN, std=STD, fill=9, seed=4)
    loader = stokehold.Loader(images, batch_size=32, seed=1, workers=2, augment=aug)
    assert loader.columns["x"] == (np.dtype(np.float32), (3, 12, 10))
    flips = 0
    for epoch in range(2):
        got = rows(loader, epoch)
        assert sorted(i for i, _ in got) == list(range(N))
        idx = np.array([i for i, _ in got], dtype=np.uint64)
        dy, dx, flip = aug.draws(epoch, idx)
        assert dy.dtype == np.int32 and flip.dtype == np.bool_
        assert np.abs(dy).max() <= 3 and np.abs(dx).max() <= 3
        flips += int(flip.sum())
        for (i, row), a, b, f in zip(got, dy, dx, flip):
            want = reference(x[i], int(a), int(b), bool(f), 3, 9, MEAN, STD)
            np.testing.assert_array_equal(row, want)
    assert 0.4 * 2 * N < flips < 0.6 * 2 * N
    # Labels pass through untouched.
    for batch in loader.epoch(0):
        np.testing.assert_array_equal(batch["y"], batch.indices.astype(np.int64))


def test_uint8_and_channels_last(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(64, 7, 9, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    aug = stokehold.Augment("x", crop=2, flip=True, channels_last=True, seed=2)
    loader = stokehold.Loader(tmp_path, batch_size=16, workers=1, augment=aug)
    assert loader.columns["x"] == (np.dtype(np.uint8), (7, 9, 3))
    got = rows(loader, 3)
    dy, dx, flip = aug.draws(3, [i for i, _ in got])
    for (i, row), a, b, f in zip(got, dy, dx, flip):
        np.testing.assert_array_equal(row, reference(x[i], a, b, f, 2, 0, channels_last=True))


def test_same_rows_on_any_worker_count_and_after_a_resume(images):
    aug = stokehold.Augment("x", crop=4, flip=True, mean=(0.5,), std=(0.25,))
    make = lambda w: stokehold.Loader(images, batch_size=16, seed=3, workers=w, augment=aug)
    whole, three = rows(make(1), 2), rows(make(3), 2)
    assert len(whole) == len(three) == N
    assert all(np.array_equal(a[1], b[1]) and a[0] == b[0] for a, b in zip(whole, three))
    first = make(2)
    head = rows(first, 2, stop=4)
    state = json.loads(json.dumps(first.state_dict()))
    second = make(3)
    second.load_state_dict(state)
    tail = rows(second, 2)
    both = head + tail
    assert len(both) == len(whole)
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(both, whole))


def test_augmented_batches_reach_torch_without_a_copy(images):
    torch = pytest.importorskip("torch")
    aug = stokehold.Augment("x", crop=1, mean=(0.5,), std=(0.5,))
    loader = stokehold.Loader(images, batch_size=8, workers=1, augment=aug)
    batch = next(iter(loader.epoch(0)))
    x = batch["x"]
    t = torch.from_dlpack(x)
    assert t.dtype == torch.float32 and tuple(t.shape) == (8, 3, 12, 10)
    assert t.data_ptr() == x.__array_interface__["data"][0]


def test_bad_augmentations_raise(images):
    with pytest.raises(stokehold.Error, match='"image".*no such column'):
        stokehold.Loader(images, augment=stokehold.Augment("image"))
    with pytest.raises(stokehold.Error, match='"y".*uint8'):
        stokehold.Loader(images, augment=stokehold.Augment("y"))
    with pytest.raises(stokehold.Error, match="2 values of mean for 3 channels"):
        stokehold.Loader(images, augment=stokehold.Augment(mean=(0.5, 0.5), std=(1, 1)))
    with pytest.raises(stokehold.Error, match="positive"):
        stokehold.Loader(images, augment=stokehold.Augment(mean=0.5, std=0))
    with pytest.raises(ValueError, match="mean and std go together"):
        stokehold.Augment(mean=(0.5,))
    with pytest.raises(ValueError, match="crop pads by 0 to 4096 pixels, not 4097"):
        stokehold.Augment(crop=4097)
    with pytest.raises(ValueError, match="not -1"):
        stokehold.Augment(crop=-1)
    with pytest.raises(ValueError, match="fill is a uint8 pixel value, 0 to 255, not 256"):
        stokehold.Augment(fill=256)
    with pytest.raises(ValueError, match="seed is an unsigned 64-bit integer, not -1"):
        stokehold.Augment(seed=-1)
    with pytest.raises(TypeError, match="stokehold.Augment"):
        stokehold.Loader(images, augment={"column": "x"})
