"""What the ONNX import does to a model before the Relax frontend sees it: reshape targets
computed from shapes folded to constants (onnxslim), and ``auto_pad`` written out as pads.
Both keep the model's meaning; both make Relax see static, plain graphs."""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np

from partune.core import trim


def fold_onnx_shapes(proto):
    """Shape sub-graphs (Shape/Gather/Concat feeding Reshape) folded to constants.

    Exporters compute reshape targets from ``x.size()`` (torchvision's channel shuffle,
    most Hugging Face exports, any dynamic axis); once the inputs are static, onnxslim's
    shape inference and constant folding turn them into constants, so Relax sees static
    shapes. A model onnxslim cannot process is imported as it is.

    onnxslim runs ONNX shape inference once a round, each time on a serialised copy of the
    whole model; its weights made that most of a large model's import (BERT-base width, 6
    layers: 27 s of 33 s). Shape inference reads only their shapes, so it is given the
    model with the large weights' data left out (``_shape_infer_without_weights``): the
    folded model is the same (checked on the benchmark's exports, both exporters).

    onnxslim stops after 10 rounds by default, converged or not; a deep model's later layers
    then keep patterns its first ones lost (BERT at 6 layers: four layers of one form, two of
    another), so identical layers did not share measurement keys. It runs to convergence.

    Each round also copies the model, weights and all (a BERT-768 at 12 layers peaked at 4.3 GB
    in this step, 7 copies of its 0.43 GB of weights). So onnxslim works on stand-ins for the
    large weights (``_WeightStandIns``): each carries its tensor's digest instead of its data, so
    two stand-ins are equal exactly when their weights are, and a weight onnxslim reads (to
    fold or fuse it) is read from the model as given. The weights are put back at the end.
    """
    import onnxslim
    import onnxslim.core

    infer = onnxslim.core.shape_infer  # onnxslim's slim() looks both up on each call
    rounds = os.environ.get("ONNXSLIM_MAX_ITER")
    onnxslim.core.shape_infer = _shape_infer_without_weights(infer)
    os.environ["ONNXSLIM_MAX_ITER"] = str(SLIM_ROUNDS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stand_ins = _WeightStandIns(proto)
            try:
                with stand_ins.readable():
                    return stand_ins.restored(onnxslim.slim(stand_ins.model, model_check=False))
            except _StandInLeft:
                return onnxslim.slim(proto, model_check=False)
    except Exception:  # noqa: BLE001 - folding is an optimisation, not a requirement
        return proto
    finally:
        onnxslim.core.shape_infer = infer
        if rounds is None:
            del os.environ["ONNXSLIM_MAX_ITER"]
        else:
            os.environ["ONNXSLIM_MAX_ITER"] = rounds


class _WeightStandIns:
    """``model``: ``proto`` with each large float weight's data replaced by a mark (a prefix and
    the data's SHA-256), which ``restored`` swaps back; within ``readable()``, onnxslim's lazy
    constants read a marked weight's values from ``proto``."""

    MARK = b"partune-weight:"

    def __init__(self, proto) -> None:
        import hashlib

        import onnx
        from onnx import helper

        self.originals: dict[bytes, onnx.TensorProto] = {}

        def stand_in(t):
            if not _is_weight(t) or not t.HasField("raw_data"):
                return t
            mark = self.MARK + hashlib.sha256(t.raw_data).digest()
            self.originals[mark] = t
            return onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=mark)

        g = proto.graph
        self.model = helper.make_model(
            helper.make_graph(
                g.node,
                g.name,
                g.input,
                g.output,
                [stand_in(t) for t in g.initializer],
                doc_string=g.doc_string,
                value_info=g.value_info,
                sparse_initializer=g.sparse_initializer,
            ),
            opset_imports=proto.opset_import,
            ir_version=proto.ir_version,
            functions=proto.functions,
        )

    def original(self, t):
        """The weight ``t`` stands in for, or None when ``t`` is no stand-in."""
        if not t.HasField("raw_data") or len(t.raw_data) != len(self.MARK) + 32:
            return None
        return self.originals.get(t.raw_data)

    @contextlib.contextmanager
    def readable(self):
        """Where onnxslim reads weights: its lazy constants, and the sub-graphs its constant
        folding exports for onnxruntime to evaluate (``fold_constants`` imports ``export_onnx``
        on each call; the rounds' own exports keep the stand-ins)."""
        from onnxslim.third_party.onnx_graphsurgeon.exporters import onnx_exporter
        from onnxslim.third_party.onnx_graphsurgeon.ir.tensor import LazyValues

        load, export = LazyValues.load, onnx_exporter.export_onnx

        def load_original(values):
            original = self.original(values.tensor)
            return load(values) if original is None else load(LazyValues(original))

        def export_originals(*args, **kwargs):
            return self.restored(export(*args, **kwargs))

        LazyValues.load, onnx_exporter.export_onnx = load_original, export_originals
        try:
            yield
        finally:
            LazyValues.load, onnx_exporter.export_onnx = load, export

    def restored(self, model):
        """``model`` with its stand-ins' data put back; an error where one is left elsewhere."""
        for t in model.graph.initializer:
            if (original := self.original(t)) is not None:
                t.raw_data = original.raw_data
        if any(
            a.type == a.TENSOR and self.original(a.t) is not None
            for n in model.graph.node
            for a in n.attribute
        ):
            raise _StandInLeft  # not seen: then onnxslim runs on the model with its weights
        return model


class _StandInLeft(Exception):
    """A stand-in ended up where ``_WeightStandIns.restored`` does not put weights back."""


def _is_weight(t) -> bool:
    """A tensor of ``_WEIGHT_BYTES`` or more that is no shape data (int64/int32 tensors are) and
    lies in the model itself (not in an external file)."""
    import onnx

    elements = int(np.prod(t.dims, dtype=np.int64))
    shape_data = t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    return (
        not shape_data
        and elements * 4 >= _WEIGHT_BYTES
        and t.data_location != onnx.TensorProto.EXTERNAL
    )


SLIM_ROUNDS = 1000  # onnxslim's rounds stop once a round changes nothing: a bound, not a count


_WEIGHT_BYTES = (
    1 << 16
)  # tensors this large are weights, not shape data (int64/int32 ones are kept whole)


def _shape_infer_without_weights(infer):
    """``infer`` (model -> model with shapes) run on a copy whose large initializers carry their
    name, type and dimensions but no data; the shapes it finds are put on the model."""
    import onnx
    from onnx import helper

    def header(t):
        return (
            onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
            if _is_weight(t)
            else t
        )

    def run(model):
        # the round before's copies, freed: each round grew the import by ~0.1 GB at 6 BERT layers
        trim()
        g = model.graph
        light = helper.make_model(
            helper.make_graph(
                g.node,
                g.name,
                g.input,
                g.output,
                [header(t) for t in g.initializer],
                value_info=g.value_info,
                sparse_initializer=g.sparse_initializer,
            ),
            opset_imports=model.opset_import,
            ir_version=model.ir_version,
            functions=model.functions,
        )
        inferred = infer(light).graph
        del g.value_info[:]
        g.value_info.extend(inferred.value_info)
        del g.output[:]
        g.output.extend(inferred.output)
        return model

    return run


def explicit_conv_pads(proto):
    """Conv ``auto_pad`` SAME_UPPER / SAME_LOWER written out as ``pads``, once shapes are static.

    torch exports ``Conv2d(padding="same")`` (Hugging Face EfficientNet, MobileNet-style
    models) as ``auto_pad=SAME_UPPER``; the Relax frontend turns every such Conv into a
    TOPI pad (a ``call_tir`` no graph-level backend can take) followed by the conv, even
    where the padding is zero. With the pads explicit the conv carries them itself.
    Computed as the ONNX spec says (and TVM's ``autopad``): total = max((ceil(i/s) - 1) * s +
    (k - 1) * d + 1 - i, 0), the odd element at the end (UPPER) or the start (LOWER).
    """
    import onnx
    from onnx import helper

    def same(node) -> bool:
        return node.op_type == "Conv" and any(
            a.name == "auto_pad" and a.s in (b"SAME_UPPER", b"SAME_LOWER") for a in node.attribute
        )

    convs = [n for n in proto.graph.node if same(n)]
    if not convs:
        return proto
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # noqa: BLE001 - then the frontend pads as it does
        return proto
    g = inferred.graph
    shapes = {t.name: list(t.dims) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            shapes[vi.name] = [
                d.dim_value if d.HasField("dim_value") else None
                for d in vi.type.tensor_type.shape.dim
            ]
    for node in convs:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
        if not x or len(x) < 3 or None in x[2:]:
            continue
        spatial = x[2:]
        kernel = list(attrs.get("kernel_shape") or (w[2:] if w else []))
        if len(kernel) != len(spatial) or None in kernel:
            continue
        strides = list(attrs.get("strides") or [1] * len(spatial))
        dilations = list(attrs.get("dilations") or [1] * len(spatial))
        upper = attrs["auto_pad"] == b"SAME_UPPER"
        begins, ends = [], []
        for i, k, st, d in zip(spatial, kernel, strides, dilations, strict=True):
            total = max((-(-i // st) - 1) * st + (k - 1) * d + 1 - i, 0)
            small, big = total // 2, total - total // 2
            begins.append(small if upper else big)
            ends.append(big if upper else small)
        keep = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend([*keep, helper.make_attribute("pads", begins + ends)])
    return proto
