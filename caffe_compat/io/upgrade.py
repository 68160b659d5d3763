"""Caffe's legacy-format upgrades, with Caffe's behaviour (``upgrade_proto.cpp``'s rules).

Applied in Caffe's order by :func:`upgrade_net`:

1. **V0 → V1** (``layers { layer { type: "conv" ... } }``): a ``padding`` layer is folded into the
   convolution/pooling that consumes it (its ``pad`` moves there, the consumer reads the padding
   layer's bottom), then each V0 layer's flat fields move into the typed ``*_param`` messages.
2. **Data transformation**: ``scale``/``mean_file``/``crop_size``/``mirror`` of Data, ImageData and
   WindowData parameters move into ``transform_param``.
3. **V1 → V2**: enum types become strings (``CONVOLUTION`` → ``"Convolution"``), ``blobs_lr`` and
   ``weight_decay`` become ``param { lr_mult decay_mult }``, ``param``/``blob_share_mode`` names
   become ``ParamSpec.name``/``share_mode``.  Blobs are kept as stored (legacy 4-D dims included).
4. **Input**: net-level ``input`` + ``input_dim``/``input_shape`` become one ``Input`` layer named
   ``input`` placed first; ``input`` names without dims or shapes (old caffemodels) are dropped.
5. **BatchNorm**: a BatchNorm layer with exactly three ``param`` specs keeps them, names included (so
   statistics shared by name stay shared), with ``lr_mult`` and ``decay_mult`` set to 0 (the statistics
   are not learnable; Caffe's BatchNorm refuses a nonzero lr_mult).

Solver files: the deprecated ``solver_type`` enum becomes the string ``type``.
"""

from __future__ import annotations

import warnings

from caffe_compat.errors import FormatError, outside_stacklevel
from caffe_compat.proto import caffe_pb2

V1 = caffe_pb2.V1LayerParameter

#: V1 enum name -> V2 type string.
V1_TYPE_NAMES = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout", "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise", "EXP": "Exp", "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output", "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData", "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct",
    "LRN": "LRN", "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence", "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice", "TANH": "TanH",
    "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

#: V1 typed parameter fields copied verbatim into the V2 layer.
_V1_PARAM_FIELDS = [f.name for f in V1.DESCRIPTOR.fields if f.name.endswith("_param") and f.name != "layer"]

#: V0 type string -> V1 enum name.
_V0_TYPES = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION", "data": "DATA",
    "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS", "flatten": "FLATTEN", "hdf5_data": "HDF5_DATA",
    "hdf5_output": "HDF5_OUTPUT", "im2col": "IM2COL", "images": "IMAGE_DATA", "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT", "lrn": "LRN", "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS",
    "pool": "POOLING", "relu": "RELU", "sigmoid": "SIGMOID", "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT", "tanh": "TANH", "window_data": "WINDOW_DATA",
}


# ---------------------------------------------------------------- detection

def needs_v0_upgrade(net: caffe_pb2.NetParameter) -> bool:
    return any(layer.HasField("layer") for layer in net.layers)


def needs_v1_upgrade(net: caffe_pb2.NetParameter) -> bool:
    return len(net.layers) > 0


def needs_input_upgrade(net: caffe_pb2.NetParameter) -> bool:
    return len(net.input) > 0


# ---------------------------------------------------------------- V0 -> V1

def _fold_padding(net: caffe_pb2.NetParameter, source: str) -> list:
    """Drop V0 ``padding`` layers, moving their pad into the consuming conv/pool layer.  As in Caffe's
    ``UpgradeV0PaddingLayers``, every bottom must be a net input or an earlier layer's top, and the checks of
    a fold (the consumer is a conv or pool layer with one bottom, the padding layer has one bottom and one
    top) are made where a padding output is consumed: an unread padding layer is dropped whatever its blobs."""
    padding_of: dict[str, caffe_pb2.V1LayerParameter] = {}  # blob -> the padding layer that last wrote it
    known = set(net.input)  # blobs written so far: Caffe's fold fails on a bottom nobody wrote
    kept = []
    for v1 in net.layers:
        v0 = v1.layer
        for bottom in v1.bottom:
            if bottom not in known:
                raise FormatError(f"{source}: V0 layer '{v0.name}' reads blob '{bottom}', which no earlier layer "
                                  f"nor net input produces (Caffe's V0 upgrade: 'Unknown blob input')")
        known.update(v1.top)
        if v0.type == "padding":
            if any(bottom in padding_of for bottom in v1.bottom):
                raise FormatError(f"{source}: V0 padding layer '{v0.name}' reads the output of another padding layer; "
                                  f"only conv and pool layers can absorb padding")
            for top in v1.top:
                padding_of[top] = v1
            continue
        new = V1()
        new.CopyFrom(v1)
        for i, bottom in enumerate(list(new.bottom)):
            padding = padding_of.get(bottom)
            if padding is not None:
                if v0.type not in ("conv", "pool"):
                    raise FormatError(f"{source}: V0 padding feeds layer '{v0.name}' of type '{v0.type}'; "
                                      f"only conv and pool layers can absorb padding")
                if len(new.bottom) != 1:
                    raise FormatError(f"{source}: V0 padding feeds layer '{v0.name}', which has {len(new.bottom)} "
                                      f"bottoms; a layer absorbing padding must have one")
                if len(padding.bottom) != 1 or len(padding.top) != 1:
                    raise FormatError(f"{source}: V0 padding layer '{padding.layer.name}' (read by '{v0.name}') "
                                      f"must have one bottom and one top")
                new.bottom[i], new.layer.pad = padding.bottom[0], padding.layer.pad
        for top in new.top:
            padding_of.pop(top, None)  # like Caffe, a blob is what its last producer wrote
        kept.append(new)
    return kept


def _v0_to_v1_layer(v1_in: caffe_pb2.V1LayerParameter, source: str) -> caffe_pb2.V1LayerParameter:
    if not v1_in.HasField("layer"):  # Caffe would keep only its bottoms and tops: a layer with no name nor type
        raise FormatError(f"{source}: layer '{v1_in.name}' is written in the V1 format (layers {{ name type ... }}) "
                          f"in a net whose other layers are V0 (layers {{ layer {{ ... }} }}); Caffe's V0 upgrade "
                          f"would drop all but its bottoms and tops: write every layer in one format")
    v0 = v1_in.layer
    out = V1()
    out.bottom.extend(v1_in.bottom)
    out.top.extend(v1_in.top)
    if v0.HasField("name"):
        out.name = v0.name
    kind = v0.type
    if kind not in _V0_TYPES:
        raise FormatError(f"{source}: layer '{v0.name}': unknown V0 layer type '{kind}'")
    out.type = V1.LayerType.Value(_V0_TYPES[kind])
    out.blobs.extend(v0.blobs)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)

    def has(field):
        return v0.HasField(field)

    if kind == "conv":
        p = out.convolution_param
        if has("num_output"): p.num_output = v0.num_output
        if has("biasterm"): p.bias_term = v0.biasterm
        if has("weight_filler"): p.weight_filler.CopyFrom(v0.weight_filler)
        if has("bias_filler"): p.bias_filler.CopyFrom(v0.bias_filler)
        if has("pad"): p.pad.append(v0.pad)
        if has("kernelsize"): p.kernel_size.append(v0.kernelsize)
        if has("group"): p.group = v0.group
        if has("stride"): p.stride.append(v0.stride)
    elif kind == "innerproduct":
        p = out.inner_product_param
        if has("num_output"): p.num_output = v0.num_output
        if has("biasterm"): p.bias_term = v0.biasterm
        if has("weight_filler"): p.weight_filler.CopyFrom(v0.weight_filler)
        if has("bias_filler"): p.bias_filler.CopyFrom(v0.bias_filler)
    elif kind == "pool":
        p = out.pooling_param
        if has("pool"): p.pool = v0.pool
        if has("kernelsize"): p.kernel_size = v0.kernelsize
        if has("stride"): p.stride = v0.stride
        if has("pad"): p.pad = v0.pad
    elif kind == "lrn":
        p = out.lrn_param
        if has("local_size"): p.local_size = v0.local_size
        if has("alpha"): p.alpha = v0.alpha
        if has("beta"): p.beta = v0.beta
        if has("k"): p.k = v0.k
    elif kind == "dropout":
        if has("dropout_ratio"): out.dropout_param.dropout_ratio = v0.dropout_ratio
    elif kind == "concat":
        if has("concat_dim"): out.concat_param.concat_dim = v0.concat_dim
    elif kind in ("data", "images", "window_data"):
        p = {"data": out.data_param, "images": out.image_data_param, "window_data": out.window_data_param}[kind]
        if has("source"): p.source = v0.source
        if has("batchsize"): p.batch_size = v0.batchsize
        if kind == "data" and has("rand_skip"): p.rand_skip = v0.rand_skip
        if kind == "images":
            if has("rand_skip"): p.rand_skip = v0.rand_skip
            if has("shuffle_images"): p.shuffle = v0.shuffle_images
            if has("new_height"): p.new_height = v0.new_height
            if has("new_width"): p.new_width = v0.new_width
        if kind == "window_data":
            if has("det_fg_threshold"): p.fg_threshold = v0.det_fg_threshold
            if has("det_bg_threshold"): p.bg_threshold = v0.det_bg_threshold
            if has("det_fg_fraction"): p.fg_fraction = v0.det_fg_fraction
            if has("det_context_pad"): p.context_pad = v0.det_context_pad
            if has("det_crop_mode"): p.crop_mode = v0.det_crop_mode
    elif kind == "hdf5_data":
        if has("source"): out.hdf5_data_param.source = v0.source
        if has("batchsize"): out.hdf5_data_param.batch_size = v0.batchsize
    elif kind == "infogain_loss":
        if has("source"): out.infogain_loss_param.source = v0.source
    elif kind == "hdf5_output":
        if has("hdf5_output_param"): out.hdf5_output_param.CopyFrom(v0.hdf5_output_param)
    # Caffe moves these four into transform_param whatever the layer's type.
    t = out.transform_param
    if has("scale"): t.scale = v0.scale
    if has("meanfile"): t.mean_file = v0.meanfile
    if has("cropsize"): t.crop_size = v0.cropsize
    if has("mirror"): t.mirror = v0.mirror
    return out


def upgrade_v0_to_v1(net: caffe_pb2.NetParameter, source: str = "net") -> None:
    """The V0 upgrade of a whole net.  Like Caffe's ``UpgradeV0Net``, which builds a fresh NetParameter, only
    ``name``, the layers, ``input``, ``input_dim`` and ``force_backward`` survive: ``input_shape``, ``state``,
    ``debug_info`` and any V2 ``layer`` of a V0 file are dropped."""
    layers = [_v0_to_v1_layer(v1, source) for v1 in _fold_padding(net, source)]
    kept = caffe_pb2.NetParameter()
    if net.HasField("name"):
        kept.name = net.name
    kept.layers.extend(layers)
    kept.input.extend(net.input)
    kept.input_dim.extend(net.input_dim)
    if net.HasField("force_backward"):
        kept.force_backward = net.force_backward
    net.CopyFrom(kept)


# ---------------------------------------------------------------- data transformation

_TRANSFORMED_PARAM = {V1.DATA: "data_param", V1.IMAGE_DATA: "image_data_param", V1.WINDOW_DATA: "window_data_param"}


def upgrade_data_transformation(net: caffe_pb2.NetParameter) -> None:
    """Move scale/mean_file/crop_size/mirror of V1 data layers into transform_param: as Caffe's
    ``UpgradeNetDataTransformation``, only from the parameter of the layer's own type (a DATA layer's
    ``data_param``, an IMAGE_DATA layer's ``image_data_param``, a WINDOW_DATA layer's ``window_data_param``)."""
    for layer in net.layers:
        name = _TRANSFORMED_PARAM.get(layer.type)
        if name is not None and layer.HasField(name):
            p = getattr(layer, name)
            t = layer.transform_param
            for field in ("scale", "mean_file", "crop_size", "mirror"):
                if p.HasField(field):
                    setattr(t, field, getattr(p, field))
                    p.ClearField(field)


# ---------------------------------------------------------------- V1 -> V2

def _v1_to_v2_layer(v1: caffe_pb2.V1LayerParameter, source: str) -> caffe_pb2.LayerParameter:
    layer = caffe_pb2.LayerParameter()
    if v1.HasField("name"):  # an unnamed V1 layer stays unnamed (no `name: ""` written), as in Caffe
        layer.name = v1.name
    layer.bottom.extend(v1.bottom)
    layer.top.extend(v1.top)
    for rule in v1.include:
        layer.include.add().CopyFrom(rule)
    for rule in v1.exclude:
        layer.exclude.add().CopyFrom(rule)
    if v1.HasField("type"):
        enum_name = V1.LayerType.Name(v1.type)
        layer.type = V1_TYPE_NAMES[enum_name]
    layer.blobs.extend(v1.blobs)

    def param(i):
        while len(layer.param) <= i:
            layer.param.add()
        return layer.param[i]

    for i, name in enumerate(v1.param):
        param(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        param(i).share_mode = mode
    for i, lr in enumerate(v1.blobs_lr):
        param(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        param(i).decay_mult = decay
    layer.loss_weight.extend(v1.loss_weight)
    for name in _V1_PARAM_FIELDS:
        if v1.HasField(name):
            getattr(layer, name).CopyFrom(getattr(v1, name))
    if v1.HasField("layer"):
        raise FormatError(f"{source}: layer '{v1.name}' still holds a V0 layer after the V0 upgrade")
    return layer


def upgrade_v1_to_v2(net: caffe_pb2.NetParameter, source: str = "net") -> None:
    """V1 ``layers`` -> V2 ``layer``.  A net that also holds V2 ``layer`` entries keeps only its upgraded V1
    layers, as Caffe's ``UpgradeV1Net`` (it logs "already specifies 'layer' fields; these will be ignored for
    the upgrade", clears them and continues); a UserWarning names the dropped layers."""
    if len(net.layer) and len(net.layers):
        dropped = ", ".join(f"'{layer.name}'" for layer in net.layer)
        warnings.warn(f"{source}: the net mixes V1 'layers' and V2 'layer' fields; like Caffe's V1 upgrade, the "
                      f"V2 layers are ignored: {dropped}", UserWarning, stacklevel=outside_stacklevel())
    new_layers = [_v1_to_v2_layer(v1, source) for v1 in net.layers]
    del net.layers[:]
    del net.layer[:]
    net.layer.extend(new_layers)


# ---------------------------------------------------------------- inputs, BatchNorm

def upgrade_input(net: caffe_pb2.NetParameter, source: str = "net") -> None:
    """Net-level ``input`` fields -> an ``Input`` layer named ``input``, first in the net.  Inputs named
    with neither ``input_shape`` nor ``input_dim`` (what an old Caffe's ``Net::ToProto`` wrote into a
    caffemodel) are only stripped, as Caffe's ``UpgradeNetInput`` strips them.  Like it, ``input_shape`` wins
    over ``input_dim`` when both are given, and entries beyond one shape (four dims) per input are ignored."""
    n = len(net.input)
    if not net.input_shape and not net.input_dim:
        net.ClearField("input")
        return
    # Caffe reads input_shape(i) (or input_dim(4i) .. input_dim(4i + 3)) for each input i: entries past those
    # are never read; fewer would be read past the end of the field, which we refuse.
    if net.input_shape and len(net.input_shape) < n:
        raise FormatError(f"{source}: {n} inputs but {len(net.input_shape)} input_shape entries")
    if not net.input_shape and len(net.input_dim) < 4 * n:
        raise FormatError(f"{source}: {n} inputs need {4 * n} input_dim values, found {len(net.input_dim)}")
    layer = caffe_pb2.LayerParameter(name="input", type="Input")
    for i, name in enumerate(net.input):
        layer.top.append(name)
        shape = layer.input_param.shape.add()
        if net.input_shape:
            shape.CopyFrom(net.input_shape[i])
        else:
            shape.dim.extend(net.input_dim[4 * i:4 * i + 4])
    rest = list(net.layer)
    del net.layer[:]
    net.layer.append(layer)
    net.layer.extend(rest)
    net.ClearField("input")
    net.ClearField("input_dim")
    net.ClearField("input_shape")


def upgrade_batch_norm(net: caffe_pb2.NetParameter) -> None:
    for layer in net.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for spec in layer.param:  # names (sharing) and share_mode kept, as Caffe's upgrade keeps them
                spec.lr_mult = 0.0
                spec.decay_mult = 0.0


# ---------------------------------------------------------------- entry points

def needs_batch_norm_upgrade(net: caffe_pb2.NetParameter) -> bool:
    return any(layer.type == "BatchNorm" and len(layer.param) == 3 for layer in net.layer)


def upgrade_net(net: caffe_pb2.NetParameter, source: str = "net") -> bool:
    """Upgrade ``net`` in place to the current format; returns True when anything changed."""
    changed = False
    if needs_v0_upgrade(net):
        upgrade_v0_to_v1(net, source)
        changed = True
    if needs_v1_upgrade(net):
        upgrade_data_transformation(net)
        upgrade_v1_to_v2(net, source)
        changed = True
    if needs_input_upgrade(net):
        upgrade_input(net, source)
        changed = True
    if needs_batch_norm_upgrade(net):
        upgrade_batch_norm(net)
        changed = True
    return changed


def upgrade_solver(solver: caffe_pb2.SolverParameter, source: str = "solver") -> bool:
    """``solver_type: NESTEROV`` -> ``type: "Nesterov"``.  Like Caffe's ``UpgradeSolverType`` (a CHECK), a
    file that sets both fields is refused, even when they agree."""
    if not solver.HasField("solver_type"):
        return False
    names = {"SGD": "SGD", "NESTEROV": "Nesterov", "ADAGRAD": "AdaGrad", "RMSPROP": "RMSProp",
             "ADADELTA": "AdaDelta", "ADAM": "Adam"}
    old_name = caffe_pb2.SolverParameter.SolverType.Name(solver.solver_type)
    new_type = names[old_name]
    if solver.HasField("type"):
        raise FormatError(f"{source}: sets both solver_type ({old_name}) and type ('{solver.type}'); Caffe refuses "
                          f"a solver with the old enum and the new string field: keep only type: \"{new_type}\"")
    solver.type = new_type
    solver.ClearField("solver_type")
    return True
