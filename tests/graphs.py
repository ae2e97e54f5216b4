"""Small hand-built Relax graphs for rule and DP tests."""

from tvm.script import ir as I
from tvm.script import relax as R


@I.ir_module
class Diamond:
    @R.function
    def main(x: R.Tensor((4, 4), "float32")):
        with R.dataflow():
            a = R.nn.relu(x)  # 0
            b = R.exp(a)  # 1
            c = R.tanh(a)  # 2
            d = R.add(b, c)  # 3
            R.output(d)
        return d


@I.ir_module
class Residual:
    @R.function
    def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 4, 3, 3), "float32")):
        with R.dataflow():
            a = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])  # 0
            b = R.nn.relu(a)  # 1
            c = R.add(b, x)  # 2
            d = R.sum(c, axis=[2, 3])  # 3
            R.output(d)
        return d


@I.ir_module
class TupleGraph:
    @R.function
    def main(x: R.Tensor((2, 8), "float32")):
        with R.dataflow():
            s = R.split(x, 2, axis=1)  # 0
            a = s[0]  # 1
            b = s[1]  # 2
            c = R.multiply(a, b)  # 3
            t = (c, a)  # 4
            d = R.concat(t, axis=1)  # 5
            R.output(d)
        return d


@I.ir_module
class Attention:
    @R.function
    def main(
        q: R.Tensor((1, 2, 8, 4), "float32"),
        k: R.Tensor((1, 2, 8, 4), "float32"),
        v: R.Tensor((1, 2, 8, 4), "float32"),
    ):
        with R.dataflow():
            kt = R.permute_dims(k, axes=[0, 1, 3, 2])  # 0
            s = R.matmul(q, kt)  # 1
            s2 = R.multiply(s, R.const(0.5, "float32"))  # 2
            p = R.nn.softmax(s2, axis=-1)  # 3
            o = R.matmul(p, v)  # 4
            R.output(o)
        return o


@I.ir_module
class Chain:
    """Eight element-wise ops in a row: dozens of TVM candidates, measured in seconds."""

    @R.function
    def main(x: R.Tensor((64, 64), "float32")):
        with R.dataflow():
            a = R.nn.relu(x)
            b = R.exp(a)
            c = R.tanh(b)
            d = R.sigmoid(c)
            e = R.multiply(d, d)
            f = R.sqrt(e)
            g = R.nn.relu(f)
            h = R.exp(g)
            R.output(h)
        return h
