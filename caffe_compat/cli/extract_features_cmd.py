"""``caffe-compat extract-features W.caffemodel NET.prototxt BLOB1[,BLOB2] DATASET1[,DATASET2] N DB_TYPE [CPU|GPU]
[DEVICE_ID]``: Caffe's ``extract_features`` tool, same arguments in the same order.

Forwards the TEST-phase net N times and writes every sample of each named blob to its dataset
(:mod:`caffe_compat.tools.features`): ``lmdb`` (Caffe's Datum records with ``float_data``, keys
``0000000000``, ``0000000001``, ...), ``npy`` or ``hdf5`` (needs h5py).  A progress bar on stderr, then
Caffe's ``Extracted features of N query images for feature blob B`` lines and a table.  As Caffe
(``strcmp(argv[7], "GPU")``), the mode ``GPU``, exactly so spelt, runs on CUDA device DEVICE_ID (read as C's
``atoi``: default 0, a negative one refused as Caffe's ``CHECK_GE(device_id, 0)``), and any other word
(``CPU``, ``gpu``) on the CPU, a DEVICE_ID after it not read.
"""

from __future__ import annotations

from caffe_compat.cli.caffe_flags import add_device_flags, atoi, int32
from caffe_compat.errors import CaffeCompatError


def register(sub) -> None:
    p = sub.add_parser("extract-features", aliases=["extract_features"],
                       help="write named blobs of N mini-batches to LMDB (Datum), .npy or HDF5 (extract_features)")
    p.add_argument("pretrained_net_param", help="the trained weights (caffemodel)")
    p.add_argument("feature_extraction_proto_file", help="the net (prototxt) with its data layer")
    p.add_argument("extract_feature_blob_names", help="blob name(s) to extract, comma-separated")
    p.add_argument("save_feature_dataset_names", help="one output path per blob, comma-separated")
    p.add_argument("num_mini_batches", type=int32, help="number of forward passes (mini-batches; an int, as Caffe's)")
    p.add_argument("db_type", help="lmdb (Caffe's Datum records), npy or hdf5")
    p.add_argument("mode", nargs="?", default="CPU",
                   help="GPU, or CPU (the default; as Caffe, any word other than GPU, lower case too, means CPU)")
    p.add_argument("device_id", nargs="?", default=None,
                   help="the CUDA device id with GPU (default 0; after CPU it is ignored, as Caffe ignores it)")
    add_device_flags(p)
    p.add_argument("--input", action="append", default=[], metavar="BLOB=FILE",
                   help="feed an Input blob the same values every batch: BLOB=FILE.npy or BLOB=FILE.npz[:KEY] "
                        "(repeatable)")
    p.add_argument("--json", metavar="PATH", help="also write what was written as JSON to PATH ('-': stdout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from caffe_compat.cli.output import dump_json, print_table, require_output_folders
    from caffe_compat.tools.features import check_request, extract_features
    from caffe_compat.tools.netsetup import build_net, load_inputs, resolve_device, split_list

    require_output_folders(*split_list(args.save_feature_dataset_names), args.json)
    # Caffe: argv[7] == "GPU" selects the GPU (DEVICE_ID, default 0); anything else runs on the CPU and
    # whatever follows it is not read
    gpu = None
    if args.mode == "GPU":
        gpu = atoi(args.device_id) if args.device_id is not None else 0
        if gpu < 0:
            raise CaffeCompatError(f"the device id after GPU must be >= 0 (Caffe's CHECK_GE(device_id, 0)), "
                                   f"got {args.device_id!r}")
        gpu = str(gpu)
    if args.gpu is not None:  # the -gpu flag its help offers (was parsed and not read: the CPU ran)
        if gpu is not None:
            raise CaffeCompatError(f"-gpu {args.gpu} and the mode GPU (device {gpu}) both choose the device; give "
                                   f"one of them")
        gpu = args.gpu
    device = resolve_device(gpu, args.device)
    net = build_net(args.feature_extraction_proto_file, args.pretrained_net_param, phase="test", device=device)
    inputs = load_inputs(args.input, net)
    blobs, datasets = split_list(args.extract_feature_blob_names), split_list(args.save_feature_dataset_names)
    check_request(net, blobs, datasets, args.num_mini_batches, args.db_type)  # errors before the progress bar
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.num_mini_batches, unit="batch", desc="Extracting features", file=sys.stderr)
    try:
        written = extract_features(net, blobs, datasets, args.num_mini_batches, args.db_type, inputs,
                                   on_batch=None if bar is None else (lambda _: bar.update(1)))
    finally:
        if bar is not None:
            bar.close()
    records = [{"blob": w.blob, "path": w.path, "count": w.count, "shape": list(w.shape)} for w in written]
    if args.json != "-":
        for w in written:
            print(f"Extracted features of {w.count} query images for feature blob {w.blob}")
        print("Successfully extracted the features!")
        print_table([[w.blob, w.path, w.count, "x".join(map(str, w.shape)) or "scalar"] for w in written],
                    ["blob", "dataset", "samples", "sample shape"])
    if args.json:
        dump_json({"db_type": args.db_type, "device": str(device), "num_mini_batches": args.num_mini_batches,
                   "features": records}, args.json)
    return 0
