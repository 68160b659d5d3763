"""The fuzz targets: per file kind, its seeds, its mutations, how a case is written to disk and which
public readers read it (in the child).  Special cases (a FIFO, ``/dev/zero``, a directory where the file
should be; for LMDB also a ``lock.mdb`` FIFO and a folder without ``data.mdb``) run before the mutations."""

from __future__ import annotations

import atexit
import io
import os
import shutil
import random
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np

from caffe_compat.errors import CaffeCompatError
from tests.conftest import fixture_path
from tests.fuzz import mutate


@dataclass
class Target:
    """One file kind: ``seeds()`` (valid files, as bytes), ``mutator(rng, data, seeds)``, ``read(path)``."""

    name: str
    make_seeds: Callable[[], list[bytes]]
    mutator: Callable[[random.Random, bytes, list[bytes]], bytes]
    read: Callable[[str], None]
    suffix: str = ".bin"
    folder: bool = False  # an LMDB: the case is a folder holding data.mdb
    extra_specials: list = field(default_factory=list)
    file_specials: bool = True  # False for text the harness itself reads from a file (param_str)

    @cached_property
    def seeds(self) -> list[bytes]:
        return self.make_seeds()

    def mutate(self, rng: random.Random) -> bytes:
        return self.mutator(rng, rng.choice(self.seeds), self.seeds)

    def write(self, data: bytes, where: Path, name: str) -> str:
        if self.folder:
            folder = where / name
            folder.mkdir()
            (folder / "data.mdb").write_bytes(data)
            return str(folder)
        suffix = self.suffix(data) if callable(self.suffix) else self.suffix
        path = where / f"{name}{suffix}"
        path.write_bytes(data)
        return str(path)

    def specials(self, where: Path) -> list[tuple[str, Callable[[], None], str]]:
        """``(label, make it, path)`` of the hostile non-files for this kind (made one at a time: each
        ``make`` expects a fresh ``where / "special"`` folder, see :func:`tests.fuzz.__main__.fuzz`)."""
        cases = []
        target = where / "special"
        if not self.file_specials:
            return cases
        suffix = self.suffix if isinstance(self.suffix, str) else ""
        inner = target / "data.mdb" if self.folder else target / f"x{suffix}"
        path = str(target) if self.folder else str(inner)
        cases.append(("fifo", lambda: os.mkfifo(inner), path))
        cases.append(("dev_zero", lambda: os.symlink("/dev/zero", inner), path))
        cases.append(("directory", lambda: inner.mkdir(), path))
        cases.append(("missing", lambda: None, path))
        for label, make in self.extra_specials:
            cases.append((label, lambda make=make: make(target), path))
        return cases


def _both(*readers):
    def read(path):
        for reader in readers:
            reader(path)
    return read


#: One folder for every file the targets write (seeds, images, outputs of the CLI targets), made when this module
#: is imported (in the parent, before any case forks) and removed when that process exits; forked cases leave
#: through ``os._exit``, so they never remove it.
_SCRATCH_ROOT = Path(tempfile.mkdtemp(prefix="caffe-compat-fuzz-"))
_SCRATCH_OWNER = os.getpid()
atexit.register(lambda: os.getpid() == _SCRATCH_OWNER and shutil.rmtree(_SCRATCH_ROOT, ignore_errors=True))


def _scratch(prefix: str) -> Path:
    """A new folder inside the scratch folder (see ``_SCRATCH_ROOT``): nothing is left in the temp folder."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH_ROOT))


# -- readers (imported here, before the runner forks) --------------------------------------------------

def _read_prototxt(path):
    from caffe_compat.io import read_net
    from caffe_compat.net_shapes import infer_shapes  # left caffe_compat.io (main moved it)

    infer_shapes(read_net(path))


def _read_caffemodel(path):
    from caffe_compat.io import read_net, read_weights

    read_weights(path)
    read_net(path)


class Disagreement(AssertionError):
    """The fast caffemodel reader and protobuf disagree on a file: a bug (an untyped exception)."""


def _caffemodel_vs_protobuf(path):
    """The in-place reader against protobuf's parser on the same bytes (see
    tests/io/test_weights_differential.py), then read_weights itself."""
    from tests.io.test_weights_differential import disagreement

    with open(path, "rb") as fh:
        data = fh.read()
    reason = disagreement(data)
    if reason:
        raise Disagreement(reason)
    from caffe_compat.io import read_weights

    read_weights(path)


def _read_solver(path):
    from caffe_compat.io import read_solver

    read_solver(path)


def _read_blob(path):
    from caffe_compat.io import read_blob

    read_blob(path)


def _read_lmdb(path):
    from caffe_compat.data.lmdb_source import DatumSource
    from caffe_compat.io import iter_lmdb, lmdb_length

    for _ in iter_lmdb(path):
        pass
    lmdb_length(path)
    source = DatumSource(path)
    for i in range(len(source)):
        source.image(i)
    source.labels()


def _read_npy(path):
    from caffe_compat.tools.netsetup import load_inputs

    load_inputs([f"data={path}"])


def _read_hdf5(path):
    from caffe_compat.data.hdf5 import read_hdf5_tops

    read_hdf5_tops(path, ["data", "label"], "fuzz", max_bytes=1 << 28)


def _read_image(path):
    from caffe_compat.data.image import load_image_bgr
    from caffe_compat.io import decode_datum, make_datum

    load_image_bgr(path)
    load_image_bgr(path, color=False, new_height=7, new_width=9)
    with open(path, "rb") as fh:
        data = fh.read()
    decode_datum(make_datum(data, 0, encoded=True))


def _read_param_str(path):
    from caffe_compat.layers.python_ports import parse_param_str

    with open(path, "rb") as fh:
        text = fh.read().decode("utf-8", "replace")
    parse_param_str(text, "fuzz")


class _ExitStatus(CaffeCompatError):
    """The CLI exited 2: its typed-error path."""


def _inspect(path):
    import contextlib

    from caffe_compat.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        status = main(["inspect", path])
    if status == 2 and "Traceback" not in err.getvalue():
        raise _ExitStatus(err.getvalue().strip()[-300:])
    if status == 1 and "defines no layers" in err.getvalue():
        return  # the documented outcome for an empty net (a warning, exit 1)
    if status != 0:
        raise RuntimeError(f"inspect exited {status}: {err.getvalue()[-300:]}")


# -- seeds ----------------------------------------------------------------------------------------------

def _file_seeds(*names):
    return lambda: [fixture_path(name).read_bytes() for name in names]


def _solver_seeds():
    text = fixture_path("solvers/nesterov/solver.prototxt").read_text()
    return [text.encode(), text.replace('type: "Nesterov"', "solver_type: NESTEROV").encode()]


def _lmdb_seeds():
    return [fixture_path(f"data/lmdb_{kind}/data.mdb").read_bytes() for kind in ("raw", "png", "jpeg")]


def _npy_seeds():
    out = []
    for array in (np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4), np.arange(6, dtype=np.float64)):
        buf = io.BytesIO()
        np.save(buf, array)
        out.append(buf.getvalue())
    buf = io.BytesIO()
    np.savez(buf, data=np.ones((1, 3, 2, 2), np.float32))
    out.append(buf.getvalue())
    return out


def _hdf5_seeds():
    import h5py

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for options in ({}, {"compression": "gzip", "chunks": (2, 3)}):
            path = Path(tmp) / "seed.h5"
            with h5py.File(path, "w") as f:
                f.create_dataset("data", data=np.arange(24, dtype=np.float64).reshape(8, 3), **options)
                f["label"] = np.arange(8)
            out.append(path.read_bytes())
    return out


def _image_seeds():
    import cv2

    with np.load(fixture_path("data/source_images.npz")) as z:
        image = z["images_chw_bgr_uint8"][0].transpose(1, 2, 0)
    return [cv2.imencode(ext, image)[1].tobytes() for ext in (".png", ".jpg", ".bmp")]


def _param_str_seeds():
    return [b" mean_file: imagenet_mean.binaryproto \n source: ./db/cub200_train_lmdb \n batch_size: 128 \n "
            b"scales : [1, 1.] \n max_number_object_per_label : 10 ",
            b"source: ../db/vehicleID_train_lmdb\nmean_file: VGG_mean.binaryproto\nbatch_size: 150\n"]


# -- mutators -------------------------------------------------------------------------------------------

def _text(rng, data, seeds):
    return mutate.mutate_text(rng, data) if rng.random() < 0.7 else mutate.mutate_bytes(rng, data, seeds)


def _protobuf(rng, data, seeds):
    return mutate.mutate_protobuf(rng, data) if rng.random() < 0.6 else mutate.mutate_bytes(rng, data, seeds)


def _npy(rng, data, seeds):
    return mutate.mutate_npy(rng, data) if rng.random() < 0.5 else mutate.mutate_bytes(rng, data, seeds)


_DATUMS: list = []


def _lmdb(rng, data, seeds):
    choice = rng.random()
    if choice < 0.55:
        return mutate.mutate_lmdb(rng, data)
    if choice < 0.75:
        return mutate.mutate_bytes(rng, data)
    return _datum_level(rng)


def _datum_level(rng):
    """A database written (by the trusted writer) with one record's Datum mutated."""
    import lmdb

    from caffe_compat.io import iter_lmdb

    if not _DATUMS:
        for kind in ("raw", "png"):
            _DATUMS.append([(key, datum.SerializeToString())
                            for key, datum, _ in iter_lmdb(fixture_path(f"data/lmdb_{kind}"), decode=False)])
    records = list(rng.choice(_DATUMS))
    i = rng.randrange(len(records))
    key, value = records[i]
    records[i] = (key, mutate.mutate_protobuf(rng, value) if rng.random() < 0.7 else mutate.mutate_bytes(rng, value))
    with tempfile.TemporaryDirectory() as tmp:
        env = lmdb.open(tmp, map_size=1 << 26)
        with env.begin(write=True) as txn:
            for key, value in records:
                txn.put(key.encode(), value)
        env.close()
        return (Path(tmp) / "data.mdb").read_bytes()


def _npy_suffix(data: bytes) -> str:
    return ".npz" if data.startswith(b"PK") else ".npy"


# -- our own files: .trainstate and checkpoints -------------------------------------------------------

_TRAINSTATE: dict = {}


def _trainstate_setup():
    """A LabelShufflingLayer net trained 3 iterations (snapshot at 3) and a Solver restored there: the
    parent builds it once, every forked case resumes into its own copy."""
    if not _TRAINSTATE:
        import logging

        from caffe_compat.solver import Solver
        from tests.solver.test_train_resume import _run, _solver_file

        logging.getLogger("caffe_compat").setLevel(logging.ERROR)
        tmp = _scratch("fuzz-trainstate-seed-")
        part = _solver_file(tmp, "label_shuffling", "part")
        _run(part, iters=3)
        state = tmp / "part" / "snap_iter_3.solverstate"
        solver = Solver(part, device="cpu")
        solver.restore(str(state))
        _TRAINSTATE.update(solver=solver, seed=state.with_suffix(".trainstate").read_bytes())
    return _TRAINSTATE


def _trainstate_seeds():
    import json

    seed = _trainstate_setup()["seed"]
    raw = json.loads(seed)
    del raw["sha256"]
    return [seed, json.dumps(raw).encode()]  # with its digest, and as an older caffe-compat wrote it


def _with_digest(raw) -> bytes:
    import hashlib
    import json

    body = json.dumps(raw, separators=(",", ":")).encode()
    if not (isinstance(raw, dict) and raw):
        return body
    return body[:-1] + b',"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'


_JSON_VALUES = [0, -1, 1, 2 ** 31, 2 ** 63, -2 ** 63, 2 ** 64, 10 ** 30, 1.5, -0.0, float("nan"), float("inf"), "", "x",
                "MT19937", None, True, False, [], {}, [1, 2, 3], {"a": 1}, {"__tuple__": [1]}, {"__items__": [[1, 2]]},
                {"__bytes__": "AAAA"}, {"__ndarray__": "AAAA", "dtype": "<u4", "shape": [1]},
                {"__ndarray__": "AAAA", "dtype": "O", "shape": [1]}, {"__tensor__": "", "dtype": "|u1", "shape": [0]},
                {"__ndarray__": "AAAA", "dtype": "<f8", "shape": [2 ** 40]}, {"__pickle__": "x"}]


def _json_nodes(node, path=()):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _json_nodes(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _json_nodes(value, path + (i,))


def _mutate_json(rng, raw):
    """One structural edit of the parsed JSON: a value replaced, a key dropped or added, a list changed."""
    import copy

    raw = copy.deepcopy(raw)
    nodes = [(p, n) for p, n in _json_nodes(raw) if p]
    path, node = rng.choice(nodes)
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    op = rng.random()
    if op < 0.55:
        value = copy.deepcopy(rng.choice(_JSON_VALUES))
        if isinstance(node, int) and not isinstance(node, bool) and rng.random() < 0.5:
            value = node + rng.choice([-1, 1, 7, 1000, -node - 1])
        parent[path[-1]] = value
    elif op < 0.7 and isinstance(parent, dict):
        del parent[path[-1]]
    elif op < 0.8 and isinstance(parent, dict):
        parent[rng.choice(["extra", "__x", "stream", "generator", "position"])] = copy.deepcopy(rng.choice(_JSON_VALUES))
    elif isinstance(node, list) and node:
        node[:] = node[: rng.randrange(len(node))] if rng.random() < 0.5 else node * rng.randint(2, 3)
    elif isinstance(node, str) and node:
        i = rng.randrange(len(node))
        parent[path[-1]] = node[:i] + rng.choice("A/+=!") + node[i + 1:]
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(_JSON_VALUES))
    return raw


def _trainstate_mutator(rng, data, seeds):
    import json

    if rng.random() < 0.3:  # bytes and text: the digest (or, without one, the parser) must catch them
        return mutate.mutate_text(rng, data) if rng.random() < 0.5 else mutate.mutate_bytes(rng, data, seeds)
    raw = json.loads(data)
    raw.pop("sha256", None)
    for _ in range(rng.choice([1, 1, 2, 3])):
        raw = _mutate_json(rng, raw)
    return _with_digest(raw)  # a valid digest: the schema is what must catch it


def _read_trainstate(path):
    from caffe_compat.solver.trainstate import load_train_state

    load_train_state(_trainstate_setup()["solver"], path[: -len(".trainstate")] + ".solverstate")


def _checkpoint_seeds():
    from converters import convert_caffe_to_torch

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed.pt"
        convert_caffe_to_torch(str(fixture_path("layer_zoo_nondiff/deploy.prototxt")),
                               str(fixture_path("layer_zoo_nondiff/weights.caffemodel")), path)
        return [path.read_bytes()]


def _checkpoint_mutator(rng, data, seeds):
    """Bytes of the zip (the digest or torch's reader must catch them), or a payload edited and saved again
    with a fresh digest (the checks of keys, the net's build and the strict state_dict must)."""
    import torch

    from caffe_compat.checkpoint import content_digest

    if rng.random() < 0.6:
        return mutate.mutate_bytes(rng, data, seeds)
    payload = torch.load(io.BytesIO(data), weights_only=True)
    op = rng.choice(["prototxt", "phase", "tensor_shape", "tensor_dtype", "drop_tensor", "extra_key", "drop_key"])
    if op == "prototxt":
        payload["net_prototxt"] = mutate.mutate_text(rng, payload["net_prototxt"].encode()).decode("utf-8", "replace")
    elif op == "phase":
        payload["phase"] = rng.choice(["train", "test", "TEST", "", 1])
    elif op in ("tensor_shape", "tensor_dtype", "drop_tensor") and payload["state_dict"]:
        key = rng.choice(sorted(payload["state_dict"]))
        tensor = payload["state_dict"][key]
        if op == "tensor_shape":
            payload["state_dict"][key] = torch.zeros(*(d + rng.choice([0, 1, 2]) for d in tensor.shape), 1)
        elif op == "tensor_dtype":
            payload["state_dict"][key] = tensor.to(rng.choice([torch.float64, torch.int64, torch.bool, torch.float16]))
        else:
            del payload["state_dict"][key]
    elif op == "extra_key":
        payload[rng.choice(["optimizer", "sha256", "format"])] = rng.choice(["x", 1, torch.zeros(2)])
    else:
        del payload[rng.choice(["net_prototxt", "phase", "state_dict"])]
    if rng.random() < 0.8:
        try:
            payload["sha256"] = content_digest(payload)
        except Exception:  # noqa: BLE001 - a payload the digest cannot describe: saved as it is
            pass
    out = io.BytesIO()
    torch.save(payload, out)
    return out.getvalue()


def _read_checkpoint(path):
    import warnings

    from caffe_compat.checkpoint import load_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(path)


def _lock_fifo(folder: Path) -> None:
    (folder / "data.mdb").write_bytes(fixture_path("data/lmdb_raw/data.mdb").read_bytes())
    os.mkfifo(folder / "lock.mdb")


# -- ONNX models and their metadata ----------------------------------------------------------------

_ONNX: dict = {}


def _onnx_setup():
    """The tiny embedder of tests/export exported once (with its preprocessing), and an image to feed it."""
    if not _ONNX:
        import cv2

        from caffe_compat.export import export_onnx
        from tests.export.helpers import TINY_PREPROCESSING, write_tiny_net

        tmp = _scratch("fuzz-onnx-seed-")
        prototxt, weights = write_tiny_net(tmp)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = export_onnx(prototxt, weights=weights, path=tmp / "m.onnx", opset=13,
                               preprocessing=TINY_PREPROCESSING)
        image = tmp / "image.png"
        cv2.imwrite(str(image), np.arange(30 * 32 * 3, dtype=np.uint8).reshape(30, 32, 3))
        _ONNX.update(seed=Path(path).read_bytes(), image=str(image))
    return _ONNX


def _onnx_seeds():
    return [_onnx_setup()["seed"]]


_METADATA_VALUES = [float("nan"), float("inf"), -1, 0, 1e5, 100000, [100000, 100000], [0, 5], [-3, 4], [28.5, 28],
                    "XYZ", "rgb", "RGB", "", None, True, [], {}, [1, 2, 3], [3, 24], [3, 24, 24, 1], [0, 24, 24],
                    [float("nan")] * 3, [1e308, 1, 1], "garbage{", {"shape": [3, 2, 2], "base64": "!!"},
                    {"shape": [3, 28, 28], "dtype": "float32", "base64": "AAAA"}, 2 ** 63, "dynamic"]


def _onnx_mutator(rng, data, seeds):
    """The model's bytes, or one or two of its metadata values replaced (a NaN scale, a bad channel order,
    a huge resize, a malformed mean image, ...) or their JSON text mutated."""
    import json

    import onnx

    if rng.random() < 0.35:
        return mutate.mutate_bytes(rng, data, seeds)
    model = onnx.load_model_from_string(data)
    props = list(model.metadata_props)
    for _ in range(rng.choice([1, 1, 2])):
        prop = rng.choice(props)
        if rng.random() < 0.7:
            prop.value = json.dumps(rng.choice(_METADATA_VALUES))
        else:
            prop.value = mutate.mutate_text(rng, prop.value.encode()).decode("utf-8", "replace")
    if rng.random() < 0.1:
        del model.metadata_props[rng.randrange(len(props))]
    return model.SerializeToString()


def _read_onnx(path):
    """What ``caffe-compat evaluate`` (and ``verify`` on an image) reads from the model: its metadata, and
    the preprocessing it describes, applied to one image."""
    from caffe_compat.export.metadata import read_metadata
    from caffe_compat.export.preprocess import ImagePreprocessor

    meta = read_metadata(path)
    ImagePreprocessor(meta, path)(_onnx_setup()["image"])


# -- Caffe solverstates through the solver's restore --------------------------------------------------

_SOLVERSTATE: dict = {}


def _solverstate_setup():
    if not _SOLVERSTATE:
        from tests.solver.caffe_cases import case_dir, make_solver

        _SOLVERSTATE.update(solver=make_solver("nesterov"), folder=case_dir("nesterov"))
    return _SOLVERSTATE


def _solverstate_seeds():
    from caffe_compat.proto import caffe_pb2

    folder = _solverstate_setup()["folder"]
    state = caffe_pb2.SolverState.FromString((folder / "snap_iter_5.solverstate").read_bytes())
    state.learned_net = str(folder / "snap_iter_5.caffemodel")  # found wherever the case is written
    without = caffe_pb2.SolverState(iter=state.iter, current_step=state.current_step, history=state.history)
    return [state.SerializeToString(), without.SerializeToString()]


def _read_solverstate(path):
    import logging

    logging.getLogger("caffe_compat").setLevel(logging.ERROR)
    _solverstate_setup()["solver"].restore(path)


# -- the command line beyond inspect ------------------------------------------------------------------

def _cli(*argv):
    """``caffe-compat ARGV``: exit 2 without a traceback is the typed-error path, 0 is ok."""
    import contextlib

    from caffe_compat.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        status = main(list(argv))
    if status == 2 and "Traceback" not in err.getvalue():
        raise _ExitStatus(err.getvalue().strip()[-300:])
    if status != 0:
        raise RuntimeError(f"{argv[0]} exited {status}: {err.getvalue()[-300:]}")


def _cli_compute_mean(path):
    out = _scratch("fuzz-mean-") / "mean.binaryproto"
    _cli("compute-mean", path, str(out))


def _cli_upgrade(path):
    out = _scratch("fuzz-upgrade-")
    _cli("upgrade", path, str(out / "new.prototxt"))


def _cli_upgrade_solver(path):
    out = _scratch("fuzz-upgrade-")
    _cli("upgrade", "--solver", path, str(out / "new.prototxt"))


def _v1_seeds():
    return [fixture_path("layer_zoo/deploy.prototxt").read_bytes()] + [
        p.read_bytes() for p in sorted(fixture_path("nets").rglob("*v1*.prototxt"))[:2]]


def _cli_make_lmdb(path):
    """``make-lmdb LIST ROOT OUT`` with the list mutated; ROOT holds a PNG and a JPEG the seeds name."""
    root = _image_root()
    out = _scratch("fuzz-lmdb-") / "db"
    _cli("make-lmdb", "--quiet", path, str(root), str(out))


_ROOT: dict = {}


def _image_root() -> Path:
    if not _ROOT:
        import cv2

        root = _scratch("fuzz-images-")
        for name, ext in (("a", ".png"), ("b", ".jpg")):
            cv2.imwrite(str(root / f"{name}{ext}"), np.full((6, 5, 3), 7, np.uint8))
        _ROOT["root"] = root
    return _ROOT["root"]


def _list_seeds():
    _image_root()
    return [b"a.png 0\nb.jpg 1\n", b"a.png 3\n\nb.jpg 4\na.png 5\n"]


# -- built and run nets: a structure-aware prototxt mutator and a reader that builds, runs and differentiates -----

#: Nets with Input layers (small shapes): what the ``net`` target mutates.
_NET_SEEDS = ("layer_zoo/deploy.prototxt", "layer_zoo_nondiff/deploy.prototxt", "solvers/nesterov/net.prototxt",
              "solvers/sgd_fappy_authors_setup/net.prototxt", "losses/softmax_valid_ignore2.prototxt",
              "losses/sigmoid_ce_valid_ignore_minus1.prototxt", "losses/contrastive_margin1.3_legacy_false.prototxt",
              "losses/euclidean.prototxt", "losses/multinomial_logistic.prototxt")

_INT_EDGES = [0, 0, -1, 1, 1, 2, 3, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 40, -2 ** 31, -2, -3, 4, 5]
_FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 1e-30, 1e30, -1e30, 3.4e38, float("nan"), float("inf"), float("-inf")]
_INT_RANGES = {"TYPE_INT32": (-2 ** 31, 2 ** 31 - 1), "TYPE_SINT32": (-2 ** 31, 2 ** 31 - 1),
               "TYPE_SFIXED32": (-2 ** 31, 2 ** 31 - 1), "TYPE_UINT32": (0, 2 ** 32 - 1),
               "TYPE_FIXED32": (0, 2 ** 32 - 1), "TYPE_INT64": (-2 ** 63, 2 ** 63 - 1),
               "TYPE_SINT64": (-2 ** 63, 2 ** 63 - 1), "TYPE_SFIXED64": (-2 ** 63, 2 ** 63 - 1),
               "TYPE_UINT64": (0, 2 ** 64 - 1), "TYPE_FIXED64": (0, 2 ** 64 - 1)}
#: LayerParameter fields the mutator leaves alone (data sources, blobs, rules: not the layer's own facts).
_SKIP_FIELDS = {"blobs", "include", "exclude", "phase", "python_param", "data_param", "image_data_param",
                "hdf5_data_param", "hdf5_output_param", "window_data_param", "memory_data_param", "transform_param",
                "dummy_data_param", "source", "mean_file", "file"}


def _type_name(fd) -> str:
    from google.protobuf.descriptor import FieldDescriptor

    return next(k for k, v in vars(FieldDescriptor).items() if k.startswith("TYPE_") and v == fd.type)


def _edge_value(rng, fd, old=None):
    kind = _type_name(fd)
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        choices = list(_INT_EDGES)
        if isinstance(old, int):
            choices += [old + 1, old - 1, old * 2, -old, old * 1000]
        return min(max(rng.choice(choices), low), high)
    if kind in ("TYPE_FLOAT", "TYPE_DOUBLE"):
        return rng.choice(_FLOAT_EDGES)
    if kind == "TYPE_BOOL":
        return not old if old is not None and rng.random() < 0.7 else rng.random() < 0.5
    if kind == "TYPE_ENUM":
        return rng.choice(fd.enum_type.values).number
    if kind == "TYPE_STRING":
        return rng.choice(["", "x", "data", "label", "gaussian", "constant", "xavier", "msra", "SUM", "-1"])
    return None


def _param_slots(message, depth=0):
    """``(message, fd)`` for every scalar fd of ``message`` and its set sub-messages (set or not)."""
    for fd in message.DESCRIPTOR.fields:
        if fd.name in _SKIP_FIELDS:
            continue
        if fd.message_type is not None:
            if depth < 3:
                if fd.is_repeated:
                    for sub in getattr(message, fd.name):
                        yield from _param_slots(sub, depth + 1)
                elif message.HasField(fd.name):
                    yield from _param_slots(getattr(message, fd.name), depth + 1)
            continue
        yield message, fd


def _mutate_field(rng, message, fd):
    repeated = fd.is_repeated
    values = getattr(message, fd.name)
    if repeated:
        op = rng.random()
        if op < 0.2 or not values:
            values.append(_edge_value(rng, fd))
        elif op < 0.35:
            del values[:]
        elif op < 0.5:
            values.append(values[rng.randrange(len(values))])
        elif op < 0.6:
            del values[rng.randrange(len(values))]
        else:
            i = rng.randrange(len(values))
            values[i] = _edge_value(rng, fd, values[i])
    else:
        setattr(message, fd.name, _edge_value(rng, fd, values if message.HasField(fd.name) else None))


def _mutate_net(rng, net):
    layers = net.layer
    if not layers:
        return
    inputs = [layer for layer in layers if layer.type == "Input" and layer.input_param.shape]
    if inputs and rng.random() < 0.12:  # an Input's shape: a dimension 0, 1 or 2, an axis of 1 added or dropped
        dims = rng.choice(rng.choice(inputs).input_param.shape).dim
        choice = rng.random()
        if choice < 0.4 and dims:
            dims[rng.randrange(len(dims))] = rng.choice([0, 1, 2])
        elif choice < 0.7:
            moved = list(dims)
            moved.insert(rng.randint(0, len(moved)), 1)
            del dims[:]
            dims.extend(moved)
        elif dims:
            del dims[rng.randrange(len(dims))]
        return
    op = rng.random()
    i = rng.randrange(len(layers))
    layer = layers[i]
    if op < 0.6:  # a parameter field of a layer (its own *_param, param specs, loss_weight, input shapes)
        slots = [(m, f) for m, f in _param_slots(layer) if f.name not in ("name", "type", "bottom", "top")]
        if not slots:
            return
        message, fd = rng.choice(slots)
        try:
            _mutate_field(rng, message, fd)
        except (ValueError, TypeError):
            pass
    elif op < 0.68:  # an unset *_param sub-message field of the layer (often the one its type reads)
        from caffe_compat.layers.registry import conventional_param_message

        params = [f.name for f in layer.DESCRIPTOR.fields if f.name.endswith("_param") and f.name not in _SKIP_FIELDS]
        own = conventional_param_message(layer.type.replace("WithLoss", ""))
        sub = getattr(layer, own if own and rng.random() < 0.8 else rng.choice(params))
        scalar = [f for f in sub.DESCRIPTOR.fields if f.message_type is None]
        if scalar:
            try:
                _mutate_field(rng, sub, rng.choice(scalar))
            except (ValueError, TypeError):
                pass
    elif op < 0.76 and layer.bottom:  # bottoms: swapped, another blob, duplicated, dropped
        tops = [t for other in layers[:i] for t in other.top] or ["data"]
        choice = rng.random()
        if choice < 0.3 and len(layer.bottom) > 1:
            a, b = rng.sample(range(len(layer.bottom)), 2)
            layer.bottom[a], layer.bottom[b] = layer.bottom[b], layer.bottom[a]
        elif choice < 0.6:
            layer.bottom[rng.randrange(len(layer.bottom))] = rng.choice(tops)
        elif choice < 0.8:
            layer.bottom.append(rng.choice(tops))
        else:
            del layer.bottom[rng.randrange(len(layer.bottom))]
    elif op < 0.82:  # tops: in place, an extra one, one fewer
        choice = rng.random()
        if choice < 0.4 and layer.bottom and layer.top:
            layer.top[0] = layer.bottom[0]
        elif choice < 0.7:
            layer.top.append(f"{layer.name}_extra")
        elif layer.top:
            del layer.top[-1]
    elif op < 0.88:  # a duplicated layer (same name, or renamed), right after itself or at the end
        copy = layers.add()
        copy.CopyFrom(layer)
        if rng.random() < 0.5:
            copy.name += "_dup"
            copy.top[:] = [t + "_dup" if rng.random() < 0.5 else t for t in copy.top]
        if rng.random() < 0.5:
            moved = list(layers)
            moved.insert(i + 1, moved.pop())
            del layers[:]
            layers.extend(moved)
    elif op < 0.93:  # another type with the same parameters
        from caffe_compat.layers.registry import registered_types

        layer.type = rng.choice([t for t in registered_types() if ":" not in t])
    elif op < 0.97:  # a layer removed
        del layers[i]
    else:  # two layers swapped
        j = rng.randrange(len(layers))
        moved = list(layers)
        moved[i], moved[j] = moved[j], moved[i]
        del layers[:]
        layers.extend(moved)


def _net_mutator(rng, data, seeds):
    from google.protobuf import text_format

    from caffe_compat.io import read_net

    if rng.random() < 0.15:
        return mutate.mutate_text(rng, data)
    net = read_net(data.decode())
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        _mutate_net(rng, net)
    text = text_format.MessageToString(net).encode()
    return mutate.mutate_text(rng, text) if rng.random() < 0.05 else text


def _run_net(path):
    """Build the net (train or test phase, from the case's bytes), run forward on inputs of the Input shapes
    (labels 0, the rest uniform) and backward of its loss, or of the sum of its outputs."""
    import zlib

    import torch

    from caffe_compat.net import CaffeNet

    os.environ["CAFFE_COMPAT_MEMORY_BUDGET"] = "256M"
    torch.manual_seed(0)
    phase = "train" if zlib.crc32(path.encode()) % 2 else "test"
    net = CaffeNet(path, phase=phase)
    inputs = {}
    for step in net.steps:  # the shapes the Input layers declare (an in-place layer may change a blob's later)
        if step.type == "Input" and step.module_key is not None:
            for name, shape in zip(step.tops, net.layers[step.module_key].output_shapes()):
                if name in net.input_names:
                    fill = torch.zeros if "label" in name or name in ("idx", "sim") else torch.rand
                    inputs[name] = fill(shape)
    blobs = net.forward(**inputs)
    if net.loss_weights:
        objective = net.objective(blobs)
        if objective.requires_grad:
            net.backward(blobs)
        return
    outputs = [blobs[n] for n in net.output_names if n in blobs and blobs[n].is_floating_point()
               and blobs[n].requires_grad]
    if outputs:
        torch.autograd.grad(sum(o.sum() for o in outputs), [p for p in net.parameters() if p.requires_grad] or outputs,
                            allow_unused=True)


TARGETS = {t.name: t for t in [
    Target("prototxt", _file_seeds("layer_zoo/deploy.prototxt", "authors/cub200/train.prototxt"), _text,
           _read_prototxt, ".prototxt"),
    Target("inspect", _file_seeds("layer_zoo/deploy.prototxt"), _text, _inspect, ".prototxt"),
    Target("caffemodel", _file_seeds("layer_zoo/weights.caffemodel"), _protobuf, _read_caffemodel, ".caffemodel"),
    Target("caffemodel_diff", _file_seeds("layer_zoo/weights.caffemodel", "layer_zoo_nondiff/weights.caffemodel",
                                          "solvers/sgd_fappy_authors_setup/init.caffemodel"),
           _protobuf, _caffemodel_vs_protobuf, ".caffemodel", file_specials=False),  # specials: "caffemodel"
    Target("solver", _solver_seeds, _text, _read_solver, ".prototxt"),
    Target("binaryproto", _file_seeds("data/mean.binaryproto", "losses/infogain_H.binaryproto"), _protobuf, _read_blob,
           ".binaryproto"),
    Target("lmdb", _lmdb_seeds, _lmdb, _read_lmdb, folder=True,
           extra_specials=[("lock_mdb_fifo", _lock_fifo), ("no_data_mdb", lambda folder: None)]),
    Target("npy", _npy_seeds, _npy, _read_npy, _npy_suffix),
    Target("hdf5", _hdf5_seeds, lambda rng, data, seeds: mutate.mutate_bytes(rng, data, seeds), _read_hdf5, ".h5"),
    Target("image", _image_seeds, lambda rng, data, seeds: mutate.mutate_bytes(rng, data, seeds), _read_image, ".img"),
    Target("param_str", _param_str_seeds, _text, _read_param_str, ".txt", file_specials=False),
    Target("trainstate", _trainstate_seeds, _trainstate_mutator, _read_trainstate, ".trainstate"),
    Target("checkpoint", _checkpoint_seeds, _checkpoint_mutator, _read_checkpoint, ".pt"),
    Target("onnx", _onnx_seeds, _onnx_mutator, _read_onnx, ".onnx"),
    Target("solverstate", _solverstate_seeds, _protobuf, _read_solverstate, ".solverstate"),
    Target("cli_compute_mean", _lmdb_seeds, _lmdb, _cli_compute_mean, folder=True),
    Target("cli_upgrade", _v1_seeds, _text, _cli_upgrade, ".prototxt"),
    Target("cli_upgrade_solver", _solver_seeds, _text, _cli_upgrade_solver, ".prototxt"),
    Target("cli_make_lmdb", _list_seeds, _text, _cli_make_lmdb, ".txt"),
    Target("net", _file_seeds(*_NET_SEEDS), _net_mutator, _run_net, ".prototxt"),
]}


def preload() -> None:
    """Import what the readers import, so that forked children start warm."""
    import caffe_compat.cli  # noqa: F401
    import caffe_compat.data.hdf5  # noqa: F401
    import caffe_compat.net_shapes  # noqa: F401
    import caffe_compat.data.image  # noqa: F401
    import caffe_compat.data.lmdb_source  # noqa: F401
    import caffe_compat.layers.python_ports  # noqa: F401
    import caffe_compat.tools.netsetup  # noqa: F401
    import caffe_compat.checkpoint  # noqa: F401
    import caffe_compat.solver.trainstate  # noqa: F401
    import tests.io.test_weights_differential  # noqa: F401
    from caffe_compat.cli import build_parser

    import caffe_compat.export.metadata  # noqa: F401
    import caffe_compat.export.preprocess  # noqa: F401
    import caffe_compat.solver  # noqa: F401
    import caffe_compat.net  # noqa: F401
    from caffe_compat.layers.registry import registered_types

    registered_types()  # every port imported

    build_parser()
