"""The per-op translator table: Relax op name -> the function that emits its ONNX nodes.

Each translator takes the graph under construction, the Relax call and its result type,
and returns the ONNX value(s) of the result. They are kept by op family, one module each
(``onnx_ops_elementwise``, ``onnx_ops_nn``, ``onnx_ops_tensor``); this module joins their
tables into the one ``relax_to_onnx`` looks ops up in.
"""

from __future__ import annotations

from partune.backends.onnx_graph import Translator
from partune.backends.onnx_ops_elementwise import TRANSLATORS as _ELEMENTWISE
from partune.backends.onnx_ops_nn import TRANSLATORS as _NN
from partune.backends.onnx_ops_tensor import TRANSLATORS as _TENSOR

TRANSLATORS: dict[str, Translator] = {**_ELEMENTWISE, **_NN, **_TENSOR}
