"""``caffe-compat export NET.prototxt (--weights W.caffemodel | --checkpoint model.pt) -o embedder.onnx
--output BLOB [--strict] [--normalize] [--opset N] [--fp16] [--fuse] [--batch dynamic|N] [--preprocessing JSON]
[--compile] [--verify] [--verify-input PATH ...] [--tolerance T]``

Calls :func:`caffe_compat.export.export_onnx`; ``--verify`` then runs :func:`verify_onnx` (onnx.checker,
ONNX Runtime vs PyTorch on a random batch and on every ``--verify-input``) and prints max abs/rel error per
input.  ``--fuse`` folds BatchNorm/Scale/Bias (+ an Eltwise shortcut) + ReLU into the convolutions
(:mod:`caffe_compat.fuse`); ``--verify`` then compares with the unfused net, within the tolerance recorded in
the model (``2·γ_(K+8)``, at least 1e-4).  ``--verify-input PATH`` (repeatable, implies ``--verify``): a ``.npy``/``.npz`` array already in the
net's input layout ``(N, C, H, W)`` (an ``.npz`` gives the array named after the input blob, e.g. a
fixture's ``blobs.npz``, or its only array), or an image file (jpg, png, ...) preprocessed with the
preprocessing stored in the exported model, as ``caffe-compat evaluate`` does
(:func:`caffe_compat.export.verify.load_verify_input`).  With ``--verify`` the model is written to a
temporary file and moved into place only when it passes; a missing, unreadable or wrongly shaped
verification input is a bad input (exit 2, one line naming the file and what was expected, nothing written).

``--compile``: the graph is captured by ``torch.export`` from the compilable net (one graph, no graph
break, as ``train --compile`` compiles it) and written by PyTorch's dynamo exporter
(``torch.onnx.export(..., dynamo=True)``) instead of the TorchScript tracer; every other option works the
same and the metadata is the same.  It needs ``onnxscript`` (``pip install 'caffe-compat[compile]'``) and
opset 18..20 (default 18 with ``--compile``, 17 without).  Refused (exit 2, one line): onnxscript not
installed, ``--opset`` below 18, a cut holding a layer that is not one graph (a user Python layer, named);
never a silent fallback to the tracer.

Preprocessing: ``--preprocessing`` (keys ``channel_order``, ``resize``, ``crop_size``, ``mean_value`` or
``mean_file`` (a .binaryproto, stored in the model), ``scale``); without it, what the net's TEST-phase data
layer applies (its ``transform_param``), else "resize to the input size, no crop, no mean", recorded as
assumed in the metadata and announced on stderr (``caffe-compat export: warning: ...``).  Data layers are
never opened, so a training prototxt exports without its training data.

Exit status: 0 written (and verified), 1 verification above tolerance on any input (nothing written), 2 bad
input (unknown blob: the message lists the available ones; unreadable files; unexportable layer; a bad
``--verify-input``; a ``-o`` folder that does not exist; with ``--strict``, ``--weights`` whose layer names
do not match the net; the ``--compile`` refusals above), nothing written.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("export", help="cut a Caffe net at its embedding blob and write an ONNX embedder")
    p.add_argument("prototxt", metavar="NET.prototxt", help="the net (deploy or train/test prototxt)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--weights", metavar="W.caffemodel", help="Caffe weights")
    source.add_argument("--checkpoint", metavar="model.pt", help="caffe-compat checkpoint")
    p.add_argument("-o", dest="path", required=True, metavar="embedder.onnx", help="ONNX file to write")
    p.add_argument("--output", dest="blob", default=None, metavar="BLOB",
                   help="embedding blob to cut at (default: fc_embedding when the net has it, else the net's "
                        "only output blob)")
    p.add_argument("--normalize", action="store_true", help="append row-wise L2 normalisation")
    p.add_argument("--opset", type=int, help="ONNX opset (default 17; 18 with --compile)")
    p.add_argument("--strict", action="store_true",
                   help="with --weights: refuse (exit 2) a caffemodel whose layer names do not match the net "
                        "(layers the net lacks, or net layers with blobs it does not cover); without it, a warning")
    p.add_argument("--fp16", action="store_true", help="float16 weights and arithmetic (float32 input/output)")
    p.add_argument("--fuse", action="store_true",
                   help="fold BatchNorm/Scale (+ shortcut) + ReLU into the convolutions (verified against the "
                        "unfused net)")
    p.add_argument("--batch", default="dynamic", help="'dynamic' (default) or a fixed batch size")
    p.add_argument("--preprocessing", metavar="JSON",
                   help='preprocessing to store, JSON text or a .json file, e.g. \'{"resize": 256, "crop_size": 224, '
                        '"mean_value": [104, 117, 123]}\' or {..., "mean_file": "mean.binaryproto"} (default: the '
                        "TEST-phase data layer's transform_param, else resize to the input size, with a warning)")
    p.add_argument("--compile", action="store_true",
                   help="capture the graph with torch.export (one graph, dynamo exporter) instead of the "
                        "TorchScript tracer; needs onnxscript (pip install 'caffe-compat[compile]') and opset >= 18")
    p.add_argument("--verify", action="store_true", help="check the model and compare ONNX Runtime with PyTorch")
    p.add_argument("--verify-input", dest="verify_inputs", action="append", default=[], metavar="PATH",
                   help="also verify on this input (repeatable; implies --verify): a .npy/.npz array in the net's "
                        "input layout (N, C, H, W), or an image file preprocessed as stored in the model")
    p.add_argument("--tolerance", type=float, help="verification bound on max_rel (default 1e-4, fp16 1e-2, "
                                                     "--fuse the bound recorded in the model)")
    p.set_defaults(func=run)


def _preprocessing(text):
    import json
    from pathlib import Path

    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.io.safe_open import read_regular_text

    if text is None:
        return None
    source = Path(text) if text.strip().lower().endswith(".json") else None  # prep.json, PREP.JSON
    try:  # a file saved with a UTF-8 byte-order mark (a Windows editor) reads as without it
        value = json.loads(read_regular_text(source, "--preprocessing", encoding="utf-8-sig")
                           if source is not None else text)
    except OSError as exc:
        raise CaffeCompatError(f"{text}: cannot read the preprocessing file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise CaffeCompatError(f"{text}: the preprocessing file is not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CaffeCompatError(f"--preprocessing: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CaffeCompatError(f"--preprocessing: expected a JSON object, got {type(value).__name__}")
    return value


def _verify_inputs(paths, check) -> dict:
    """``{case name: path}`` for ``--verify-input``: the path as given (``#2``, ... for a repeated one)."""
    inputs = {}
    for text in paths:
        check(text)
        name, count = text, 1
        while name in inputs or name == "random":
            count += 1
            name = f"{text}#{count}"
        inputs[name] = text
    return inputs


def run(args) -> int:
    import os

    from caffe_compat.cli.output import print_table
    from caffe_compat.export import export_onnx, verify_onnx
    from caffe_compat.export.notices import cli_warnings
    from caffe_compat.export.metadata import read_metadata
    from caffe_compat.export.onnx_export import default_opset, require_onnxscript
    from caffe_compat.export.verify import check_verify_input_path
    from caffe_compat.io.atomic import refuse_special_target, require_folder

    if args.tolerance is not None and not args.tolerance >= 0:  # NaN too: no max_rel is <= NaN
        from caffe_compat.errors import CaffeCompatError

        raise CaffeCompatError(f"--tolerance must be a number >= 0, got {args.tolerance}")
    if args.compile:
        require_onnxscript()  # before any work: a missing package is one line, exit 2
    opset = default_opset(args.compile) if args.opset is None else args.opset
    target = require_folder(args.path)
    refuse_special_target(target)  # --verify renames its file into place too
    args.verify = bool(args.verify or args.verify_inputs)
    inputs = _verify_inputs(args.verify_inputs, check_verify_input_path)  # missing files fail before the export
    path = target.with_name(f".{target.name}.verify{os.getpid()}.onnx") if args.verify else target
    try:
        with cli_warnings("export"):
            export_onnx(args.prototxt, weights=args.weights, checkpoint=args.checkpoint, output_blob=args.blob,
                        path=path, normalize=args.normalize, opset=opset, fp16=args.fp16, batch=args.batch,
                        preprocessing=_preprocessing(args.preprocessing), strict=args.strict, fuse=args.fuse,
                        compile=args.compile)
        if args.verify:
            report = verify_onnx(path, prototxt=args.prototxt, weights=args.weights, checkpoint=args.checkpoint,
                                 tolerance=args.tolerance, inputs=inputs or None, random=True)
            rows = [[name, c["batch"], f"{c['max_abs']:.3e}", f"{c['max_rel']:.3e}"]
                    for name, c in report["cases"].items()]
            print(f"onnx.checker: {report['checker']}; ONNX Runtime ({report['provider']}) vs PyTorch:")
            print_table(rows, ["input", "batch", "max abs", "max rel"])
            if not report["passed"]:
                failed = [name for name, c in report["cases"].items() if not c["max_rel"] <= report["tolerance"]]
                print(f"verification FAILED on {', '.join(failed)}: max rel {report['max_rel']:.3e} > tolerance "
                      f"{report['tolerance']:.1e}; {target} not written")
                return 1
            print(f"verification passed (max rel {report['max_rel']:.3e} <= {report['tolerance']:.1e})")
            os.replace(path, target)
    finally:
        if args.verify and path.exists():
            path.unlink()
    blob = read_metadata(target)["output_blob"]
    print(f"wrote {target}: blob '{blob}'{' L2-normalised' if args.normalize else ''}, opset {opset}, "
          f"batch {args.batch}{', fp16' if args.fp16 else ''}{', fused' if args.fuse else ''}"
          f"{', torch.export' if args.compile else ''}")
    return 0
