"""CIFAR-10/100 and ImageFolder loaders: real on-disk formats, disjoint shards, determinism, resumption."""

from __future__ import annotations

import functools
import hashlib
import http.server
import pickle
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image
from torchvision import datasets

from subnetdp.cli import main
from subnetdp.train.configure import load_config
from subnetdp.core.errors import ConfigError
from subnetdp.plugins.data.cifar import CifarData
from tests.helpers import plugin_manager

REG = plugin_manager().registries


def write_cifar(root: Path, hundred: bool, per_file: int = 10, n_test: int = 20) -> tuple[np.ndarray, list[int]]:
    """The official layout: pickled dicts (protocol 2, str keys as Python 2 wrote them), rows of 3072 bytes
    (1024 red, 1024 green, 1024 blue, row-major). Returns the training images (N, 3, 32, 32) and labels."""
    rng = np.random.default_rng(1 if hundred else 0)
    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    names = ["train"] if hundred else [f"data_batch_{i}" for i in range(1, 6)]
    images, labels = [], []
    for name in names + ["test" if hundred else "test_batch"]:
        n = n_test if name.startswith("test") else per_file * (5 if hundred else 1)
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        y = rng.integers(0, 100 if hundred else 10, n).tolist()
        entry = {"batch_label": f"batch {name}", "data": data, "filenames": [f"{name}_{i}.png" for i in range(n)]}
        entry.update({"fine_labels": y, "coarse_labels": [c // 5 for c in y]} if hundred else {"labels": y})
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
        if not name.startswith("test"):
            images.append(data.reshape(n, 3, 32, 32))
            labels += y
    meta = ({"fine_label_names": [f"f{i}" for i in range(100)], "coarse_label_names": [f"c{i}" for i in range(20)]}
            if hundred else {"label_names": [f"l{i}" for i in range(10)], "num_cases_per_batch": per_file, "num_vis": 3072})
    (folder / ("meta" if hundred else "batches.meta")).write_bytes(pickle.dumps(meta, protocol=2))
    return np.concatenate(images), labels


def _data(name: str, *overrides: str):
    cfg = load_config(None, [f"data.name={name}", *overrides], REG)
    return REG["data"].get(name)(cfg.data, seed=3)


def _take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))


def _check_shards(data, n: int, batch: int) -> None:
    """Two ranks' shards are disjoint, cover the data, and reshuffle every epoch."""
    loaders = [data.train_loader(r, 2, batch) for r in range(2)]
    for epoch in range(2):
        shards = [set(ld.shard(epoch)) for ld in loaders]
        assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(n))
    assert loaders[0].shard(0) != loaders[0].shard(1)


@pytest.mark.parametrize("name,hundred", [("cifar10", False), ("cifar100", True)])
def test_cifar_reads_the_real_format_sharded_deterministic_resumable(tmp_path, name, hundred):
    images, labels = write_cifar(tmp_path, hundred)
    plain = _data(name, f"data.root={tmp_path}", "data.verify_checksums=false", "data.augment=false")
    assert plain.spec().num_classes == (100 if hundred else 10) and plain.spec().image_size == 32
    _check_shards(plain, 50, 5)
    # Unaugmented batches are exactly the written images (CHW), normalised, in the shard's order.
    mean, std = torch.tensor(plain.mean).view(3, 1, 1), torch.tensor(plain.std).view(3, 1, 1)
    loader = plain.train_loader(1, 2, 5)
    order = loader.shard(0)
    for b, (x, y) in enumerate(_take(loader, 5)):
        idx = order[b * 5:(b + 1) * 5]
        expected = (torch.from_numpy(images[idx]).float() / 255 - mean) / std
        torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)
        assert y.tolist() == [labels[i] for i in idx]
    # The held-out split, whole and in order.
    test = list(plain.eval_loader(8))
    assert sum(len(b[1]) for b in test) == 20 and test[0][0].shape == (8, 3, 32, 32)

    data = _data(name, f"data.root={tmp_path}", "data.verify_checksums=false")
    augmented = _take(data.train_loader(0, 2, 5), 7)  # crosses into epoch 1
    assert _same(augmented, _take(_data(name, f"data.root={tmp_path}", "data.verify_checksums=false")
                                  .train_loader(0, 2, 5), 7))  # deterministic
    assert not _same(augmented[:5], _take(plain.train_loader(0, 2, 5), 5))  # crop and flip did something
    assert all(x.shape == (5, 3, 32, 32) for x, _ in augmented)
    # Resuming from a saved position gives the batches an uninterrupted run would have read.
    first = data.train_loader(0, 2, 5)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert state == {"epoch": 0, "batch": 4}
    resumed = data.train_loader(0, 2, 5)
    resumed.load_state_dict(state)
    assert _same(_take(resumed, 3), augmented[4:7])
    # Worker processes load the very same batches.
    workers = _data(name, f"data.root={tmp_path}", "data.verify_checksums=false", "data.num_workers=1")
    assert _same(_take(workers.train_loader(0, 2, 5), 2), augmented[:2])
    # data.image_size resizes.
    small = _data(name, f"data.root={tmp_path}", "data.verify_checksums=false", "data.image_size=16")
    assert small.spec().image_size == 16 and _take(small.train_loader(0, 1, 4), 1)[0][0].shape == (4, 3, 16, 16)


def test_missing_or_modified_cifar_is_a_clear_error_before_any_process_group(tmp_path, capsys):
    for name, folder, url in [("cifar10", "cifar-10-batches-py", "cifar-10-python.tar.gz"),
                              ("cifar100", "cifar-100-python", "cifar-100-python.tar.gz")]:
        with pytest.raises(ConfigError) as e:
            _data(name, f"data.root={tmp_path / 'nowhere'}").check()
        msg = str(e.value)
        assert msg.startswith("data.root=") and f"{tmp_path / 'nowhere' / folder}/" in msg
        assert "data.download=true" in msg and url in msg and "missing:" in msg
    # From the command line: exit code 2, the message, and no process group was ever created.
    code = main(["train", "data.name=cifar10", f"data.root={tmp_path / 'nowhere'}", "comm.name=gloo",
                 f"run.dir={tmp_path / 'runs'}", "train.progress=false"])
    assert code == 2 and "cifar-10-batches-py" in capsys.readouterr().err
    assert not dist.is_initialized()
    # A file that is not the published one fails the checksum, with the way out.
    write_cifar(tmp_path, hundred=False)
    with pytest.raises(ConfigError, match=r"MD5 differs.*data.verify_checksums=false"):
        _data("cifar10", f"data.root={tmp_path}").check()


@pytest.fixture
def http_server(tmp_path):
    """A local HTTP server over ``tmp_path / 'www'`` (an ephemeral port on 127.0.0.1)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_download_fetches_and_extracts_the_archive(tmp_path, http_server):
    """The real download path (torchvision's fetch, MD5 check and extraction), from a local mirror."""
    www, url = http_server
    write_cifar(tmp_path / "src", hundred=False)
    archive = www / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    mirror = type("Mirror", (datasets.CIFAR10,), {
        "url": f"{url}/cifar-10-python.tar.gz", "tgz_md5": md5, "train_list": [[f"data_batch_{i}", None] for i in range(1, 6)],
        "test_list": [["test_batch", None]], "meta": {**datasets.CIFAR10.meta, "md5": None}})
    local = type("LocalCifar", (CifarData,), {"dataset": mirror})
    cfg = load_config(None, ["data.name=cifar10", f"data.root={tmp_path / 'data'}", "data.download=true",
                         "data.verify_checksums=false"], REG)
    data = local(cfg.data)
    data.check()
    assert (tmp_path / "data" / "cifar-10-batches-py" / "test_batch").is_file()
    assert len(data.train_loader(0, 1, 10).shard(0)) == 50
    broken = type("Broken", (CifarData,), {"dataset": type("Gone", (mirror,), {"url": f"{url}/no.tgz"})})
    cfg.data.root = str(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"data.download=True: fetching .*no.tgz failed"):
        broken(cfg.data).check()


def write_imagefolder(root: Path, classes: int = 3, train: int = 10, val: int = 4) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for c in range(classes):
            d = root / split / f"n0{c}"
            d.mkdir(parents=True)
            for i in range(n):
                h, w = 36 + 4 * (i % 3), 44 - 2 * (i % 2)
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"{i}.png")


def test_imagefolder_tree_sharded_deterministic_with_the_usual_transforms(tmp_path):
    write_imagefolder(tmp_path / "in")
    data = _data("imagenet", f"data.root={tmp_path / 'in'}", "data.image_size=24")
    spec = data.spec()
    assert (spec.num_classes, spec.in_channels, spec.image_size) == (3, 3, 24)
    _check_shards(data, 30, 3)
    batches = _take(data.train_loader(1, 2, 3), 6)  # crosses into epoch 1
    assert all(x.shape == (3, 3, 24, 24) and x.dtype == torch.float32 for x, _ in batches)
    assert _same(batches, _take(_data("imagenet", f"data.root={tmp_path / 'in'}", "data.image_size=24")
                                .train_loader(1, 2, 3), 6))
    order = data.train_loader(1, 2, 3).shard(0)
    assert [int(y) for _, ys in batches[:5] for y in ys] == [i // 10 for i in order]  # class folder = label
    val = list(data.eval_loader(5))
    assert [int(y) for _, ys in val for y in ys] == [0] * 4 + [1] * 4 + [2] * 4
    assert _same(val, list(data.eval_loader(5)))  # resize + centre crop: no randomness


def test_imagefolder_missing_or_mismatched_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        _data("imagenet", f"data.root={tmp_path / 'none'}").check()
    assert str(tmp_path / "none" / "train") in str(e.value) and "image-net.org" in str(e.value)
    write_imagefolder(tmp_path / "in", train=1, val=1)
    (tmp_path / "in" / "val" / "n00").rename(tmp_path / "in" / "val" / "n09")
    with pytest.raises(ConfigError, match=r"different class folders.*only in train: \['n00'\].*only in val: \['n09'\]"):
        _data("imagenet", f"data.root={tmp_path / 'in'}").check()


def test_a_shard_smaller_than_one_batch_names_the_batch_size(tmp_path):
    write_imagefolder(tmp_path / "in")  # 30 training images
    data = _data("imagenet", f"data.root={tmp_path / 'in'}", "data.image_size=24")
    with pytest.raises(ConfigError, match=r"train\.batch_size=16: each of the 4 ranks' shards holds 7 of the 30 .*"
                                          r"train\.batch_size<=7"):
        data.train_loader(0, 4, 16)


def test_digits_read_from_the_file_equal_scikit_learns_loader_without_importing_it():
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits

    from subnetdp.plugins.data.digits import _digits

    images, target = _digits()
    d = load_digits()
    assert np.array_equal(images, d.images) and images.dtype == d.images.dtype
    assert np.array_equal(target, d.target)
    # A worker that loads the digits does not pay for importing scikit-learn.
    code = ("import sys; from subnetdp.plugins.data.digits import _digits; _digits(); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
