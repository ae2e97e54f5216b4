"""The user's calibration and validation data: every accepted form read, every misfit refused
with one line that names the file."""

from __future__ import annotations

import numpy as np
import pytest

from partune.core import PartuneError
from partune.frontend import load_samples, split_samples, synthetic_samples

NAMES, SHAPES, DTYPES = ["ids", "x"], [(1, 4), (2, 3)], ["int64", "float32"]


def _sample(i: int) -> dict[str, np.ndarray]:
    return {
        "ids": np.arange(4, dtype="int64").reshape(1, 4) + i,
        "x": np.full((2, 3), float(i), "float32"),
    }


def _same(got: list[list[np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(want)
    for sample, arrays in zip(got, want, strict=True):
        for a, name, dtype in zip(sample, NAMES, DTYPES, strict=True):
            assert a.dtype == np.dtype(dtype) and np.array_equal(a, arrays[name])


def _refused(match: str, *args) -> str:
    with pytest.raises(PartuneError, match=match) as e:
        load_samples(*args)
    message = str(e.value)
    assert "\n" not in message
    return message


# -- the accepted forms -----------------------------------------------------------------


def test_a_folder_of_npz_files_is_read_in_sorted_name_order(tmp_path):
    for i in (10, 2, 1):  # sorted by name: 1, 10, 2
        np.savez(tmp_path / f"s{i}.npz", **_sample(i))
    (tmp_path / "notes.txt").write_text("not a sample")
    _same(load_samples(tmp_path, NAMES, SHAPES, DTYPES), [_sample(1), _sample(10), _sample(2)])


def test_a_single_input_takes_any_one_array_of_an_npz(tmp_path):
    np.savez(tmp_path / "a.npz", whatever=np.ones((2, 3), "float32"))
    (got,) = load_samples(tmp_path, ["x"], [(2, 3)], ["float32"])
    assert len(got) == 1 and np.array_equal(got[0], np.ones((2, 3)))


def test_a_folder_of_npy_files_for_a_single_input(tmp_path):
    for i in range(3):
        np.save(tmp_path / f"{i}.npy", np.full((2, 3), i, "float32"))
    got = load_samples(tmp_path, ["x"], [(2, 3)], ["float32"])
    assert [float(s[0][0, 0]) for s in got] == [0.0, 1.0, 2.0]


def test_one_npz_file_of_stacked_samples(tmp_path):
    samples = [_sample(i) for i in range(5)]
    np.savez(tmp_path / "all.npz", **{n: np.stack([s[n] for s in samples]) for n in NAMES})
    _same(load_samples(tmp_path / "all.npz", NAMES, SHAPES, DTYPES), samples)


def test_safe_casts_convert(tmp_path):
    np.savez(
        tmp_path / "a.npz",
        ids=np.array([[1, 2, 3, 4]], "int64"),
        x=np.full((2, 3), 0.5, "float64"),
    )
    (sample,) = load_samples(tmp_path, NAMES, SHAPES, ["int32", "float32"])
    assert sample[0].dtype == np.int32 and sample[1].dtype == np.float32
    assert np.array_equal(sample[0], [[1, 2, 3, 4]]) and np.all(sample[1] == 0.5)


# -- what is refused --------------------------------------------------------------------


def test_a_missing_path(tmp_path):
    assert str(tmp_path / "nope") in _refused("no such", tmp_path / "nope", NAMES, SHAPES, DTYPES)


def test_an_empty_folder(tmp_path):
    (tmp_path / "readme.txt").write_text("x")
    assert str(tmp_path) in _refused("no .npy or .npz", tmp_path, NAMES, SHAPES, DTYPES)


@pytest.mark.parametrize("kind", ["garbage", "truncated", "bad zip", "bad member", "objects"])
def test_a_corrupt_file(tmp_path, kind):
    f = tmp_path / ("s.npy" if kind in ("garbage", "truncated") else "s.npz")
    if kind == "garbage":
        f.write_text("hello, not numpy")
    elif kind == "truncated":
        np.save(f, np.ones((2, 3), "float32"))
        f.write_bytes(f.read_bytes()[:-8])
    elif kind == "bad zip":
        np.savez(f, x=np.ones((2, 3), "float32"))
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    elif kind == "bad member":
        np.savez_compressed(f, x=np.random.default_rng(0).random((2, 3)))
        data = bytearray(f.read_bytes())
        data[60:120] = b"x" * 60  # inside the compressed array
        f.write_bytes(bytes(data))
    else:
        np.savez(f, x=np.array([{"a": 1}], dtype=object))  # a pickle inside: never loaded
    assert str(f) in _refused(".", tmp_path, ["x"], [(2, 3)], ["float32"])


def test_an_npy_folder_for_a_model_of_several_inputs(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2, 3), "float32"))
    msg = _refused("holds one array", tmp_path, NAMES, SHAPES, DTYPES)
    assert str(tmp_path / "a.npy") in msg


def test_a_sample_missing_an_input_or_holding_an_unknown_name(tmp_path):
    np.savez(tmp_path / "a.npz", ids=_sample(0)["ids"], y=_sample(0)["x"])
    msg = _refused("lacks input x and holds unknown name y", tmp_path, NAMES, SHAPES, DTYPES)
    assert str(tmp_path / "a.npz") in msg


def test_a_shape_that_does_not_fit(tmp_path):
    np.savez(tmp_path / "a.npz", ids=np.zeros((1, 5), "int64"), x=_sample(0)["x"])
    fits = r"input ids has shape \(1, 5\), the model takes \(1, 4\)"
    msg = _refused(fits, tmp_path, NAMES, SHAPES, DTYPES)
    assert str(tmp_path / "a.npz") in msg


def test_a_stacked_file_of_the_wrong_shape_or_uneven_counts(tmp_path):
    f = tmp_path / "all.npz"
    np.savez(f, ids=np.zeros((3, 1, 4), "int64"), x=np.zeros((3, 3, 2), "float32"))
    assert str(f) in _refused(r"expected \(N, 2, 3\)", f, NAMES, SHAPES, DTYPES)
    np.savez(f, ids=np.zeros((3, 1, 4), "int64"), x=np.zeros((2, 2, 3), "float32"))
    assert str(f) in _refused("different numbers of samples", f, NAMES, SHAPES, DTYPES)


@pytest.mark.parametrize(
    "have, want, why",
    [
        ("float32", "int64", "cast it yourself"),  # a float to an integer
        ("float64", "int32", "cast it yourself"),
        ("bool", "float32", "booleans only"),
        ("int64", "bool", "booleans only"),
        ("float32", "bool", "booleans only"),
    ],
)
def test_a_dtype_that_cannot_be_cast_safely(tmp_path, have, want, why):
    np.save(tmp_path / "a.npy", np.ones((2, 3), have))
    msg = _refused(why, tmp_path, ["x"], [(2, 3)], [want])
    assert str(tmp_path / "a.npy") in msg and have in msg and want in msg


def test_floats_that_overflow_the_target_are_refused(tmp_path):
    np.save(tmp_path / "a.npy", np.full((2, 3), 1e6))
    assert "range" in _refused("float16", tmp_path, ["x"], [(2, 3)], ["float16"])


def test_integers_out_of_the_target_range_are_refused(tmp_path):
    np.save(tmp_path / "a.npy", np.array([2**40], "int64"))
    assert "range" in _refused("int32", tmp_path, ["ids"], [(1,)], ["int32"])


# -- split and synthetic samples ---------------------------------------------------------


@pytest.mark.parametrize("n, held", [(2, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_the_last_quarter_is_held_out(n, held):
    samples = [[np.full(1, i)] for i in range(n)]
    cal, val, note = split_samples(samples)
    assert len(val) == held and len(cal) == n - held and cal + val == samples
    assert "\n" not in note and f"{n - held} sample" in note and f"{held} sample" in note
    assert "held out" in note


def test_a_single_sample_serves_both_and_the_note_says_so():
    samples = [[np.zeros(1)]]
    cal, val, note = split_samples(samples)
    assert cal == val == samples and "both" in note and "\n" not in note


def test_a_given_validation_set_is_kept_whole():
    samples, validation = [[np.zeros(1)]] * 3, [[np.ones(1)]] * 2
    cal, val, note = split_samples(samples, validation)
    assert cal is samples and val is validation
    assert "3 samples to calibrate" in note and "2 samples given" in note


def test_split_refuses_no_samples_and_a_share_out_of_range():
    with pytest.raises(PartuneError):
        split_samples([])
    with pytest.raises(PartuneError):
        split_samples([[np.zeros(1)]] * 4, held_out_share=1.0)


def test_synthetic_samples_are_seeded_and_look_like_the_inputs():
    ids = np.array([[3, 7, 9, 4]], "int64")
    x = np.random.default_rng(1).normal(5.0, 2.0, (64, 64)).astype("float32")
    a, b = synthetic_samples([ids, x], 3, seed=11), synthetic_samples([ids, x], 3, seed=11)
    assert len(a) == 3
    assert all(np.array_equal(u, v) for u, v in zip(sum(a, []), sum(b, []), strict=True))
    assert not np.array_equal(a[0][1], a[1][1])  # seed, seed + 1, ...: different samples
    assert np.array_equal(synthetic_samples([ids, x], 2, seed=12)[0][1], a[1][1])
    for s_ids, s_x in a:
        assert s_ids.dtype == ids.dtype and 3 <= s_ids.min() and s_ids.max() <= 9
        assert s_x.dtype == x.dtype and abs(s_x.mean() - 5.0) < 0.2
