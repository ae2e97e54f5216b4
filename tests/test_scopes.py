import pytest

from partune.core.scopes import CompilationConfig, ScopeError, SEScope

CPU = {"kind": "llvm", "num-cores": 1}


def test_join_and_default():
    a = SEScope(device_type="cpu", backend="torch")
    b = SEScope(virtual_device_id=0, target=CPU, memory_scope="global")
    j = a.join(b)
    assert j == SEScope("cpu", 0, CPU, "global", "torch")
    assert j.is_fully_constrained
    assert a.join(SEScope(backend="tvm")) is None  # conflicting backend
    assert SEScope(backend="tvm").default(j) == SEScope("cpu", 0, CPU, "global", "tvm")


def test_target_device_type_must_match():
    with pytest.raises(ScopeError, match="runs on device type 'cpu'"):
        SEScope(device_type="cuda", target=CPU)
    assert SEScope(device_type="cuda").join(SEScope(target=CPU)) is None


def test_json_round_trip():
    s = SEScope("cpu", 0, CPU, "global", "onnxruntime")
    assert SEScope.from_json(s.to_json()) == s
    assert SEScope.from_json({}) == SEScope()
    with pytest.raises(ScopeError, match="unknown SEScope field"):
        SEScope.from_json({"colour": "red"})
    cfg = CompilationConfig.for_cpu(["torch", "onnxruntime"])
    assert CompilationConfig.from_json(cfg.to_json()) == cfg
    assert cfg.backends == ("tvm", "torch", "onnxruntime")
    assert cfg.default.backend == "tvm"


def test_config_validation():
    s = SEScope("cpu", 0, CPU, "global", "tvm")
    with pytest.raises(ScopeError, match="fully constrained"):
        CompilationConfig(host=s, primitives=(s, SEScope(backend="torch")), default=s)
    with pytest.raises(ScopeError, match="default scope"):
        CompilationConfig(
            host=s, primitives=(SEScope("cpu", 0, CPU, "global", "torch"),), default=s
        )
