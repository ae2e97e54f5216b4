"""The DPL patterns of the composites the torch backend runs as one ATen call, which the
partitioner hands to FuseOpsByPattern.

Separate from the translators and the fuser: the patterns only describe to the
partitioner what the fuser will fuse, and need none of their code to do so.
"""

from __future__ import annotations

from tvm.relax import dpl

# --------------------------------------------------------------------------- patterns


def _activation_patterns(x: dpl.DFPattern) -> dict[str, dpl.DFPattern]:
    return {
        "relu": dpl.is_op("relax.nn.relu")(x),
        "gelu": dpl.is_op("relax.nn.gelu")(x),
        "gelu_tanh": dpl.is_op("relax.nn.gelu_tanh")(x),
        "silu": dpl.is_op("relax.nn.silu")(x),
        "clip": dpl.is_op("relax.clip")(x, dpl.wildcard(), dpl.wildcard()),
    }


def _constant() -> dpl.DFPattern:
    """A constant, or a reshaped/transposed one (importers emit W^T and (1, C, 1, 1) biases)."""
    c = dpl.is_const()
    return c | dpl.is_op("relax.permute_dims")(c) | dpl.is_op("relax.reshape")(c, dpl.wildcard())


def _bias_add(x: dpl.DFPattern) -> dpl.DFPattern:
    return dpl.is_op("relax.add")(x, _constant()) | dpl.is_op("relax.add")(_constant(), x)


def make_patterns() -> list[tuple[str, dpl.DFPattern]]:
    """Composites the builder turns into one ATen call, largest first.

    Attribute constraints keep out what ``accepts`` refuses (other layouts, training-mode
    batch norm, layer norm without centre or scale); dtypes are left to ``accepts``.
    """
    c = _constant
    nchw = {"data_layout": "NCHW", "kernel_layout": "OIHW", "out_layout": "NCHW"}
    conv = dpl.is_op("relax.nn.conv2d")(dpl.wildcard(), c()).has_attr(nchw)

    def bn(x: dpl.DFPattern) -> dpl.DFPattern:
        return dpl.is_op("relax.nn.batch_norm")(x, c(), c(), c(), c()).has_attr(
            {"training": False, "axis": 1}
        )

    conv_bn = bn(conv)  # rooted at the call: FuseOpsByPattern does not fuse a TupleGetItem root
    conv_bias = _bias_add(conv)
    linear = dpl.is_op("relax.matmul")(dpl.wildcard(), c())
    linear_bias = _bias_add(linear)
    pool = {"layout": "NCHW", "out_layout": "NCHW"}
    four = [
        (f"torch.conv2d_bn_{a}", p)
        for a, p in _activation_patterns(dpl.is_tuple_get_item(conv_bn, 0)).items()
    ]
    three = [(f"torch.conv2d_bias_{a}", p) for a, p in _activation_patterns(conv_bias).items()]
    three += [(f"torch.matmul_bias_{a}", p) for a, p in _activation_patterns(linear_bias).items()]
    return (
        four
        + [("torch.conv2d_bn", conv_bn)]
        + three
        + [
            ("torch.conv2d_bias", conv_bias),
            ("torch.matmul_bias", linear_bias),
            ("torch.batch_norm", bn(dpl.wildcard())),
            ("torch.conv2d", conv),
            ("torch.matmul", dpl.is_op("relax.matmul")(dpl.wildcard(), dpl.wildcard())),
            (
                "torch.layer_norm",
                dpl.is_op("relax.nn.layer_norm")(dpl.wildcard(), c(), c()).has_attr(
                    {"center": True, "scale": True}
                ),
            ),
            ("torch.softmax", dpl.is_op("relax.nn.softmax")(dpl.wildcard())),
            ("torch.max_pool2d", dpl.is_op("relax.nn.max_pool2d")(dpl.wildcard()).has_attr(pool)),
            ("torch.avg_pool2d", dpl.is_op("relax.nn.avg_pool2d")(dpl.wildcard()).has_attr(pool)),
            (
                "torch.adaptive_avg_pool2d",
                dpl.is_op("relax.nn.adaptive_avg_pool2d")(dpl.wildcard()).has_attr(pool),
            ),
        ]
    )


PATTERNS: list[tuple[str, dpl.DFPattern]] = make_patterns()
