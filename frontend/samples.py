"""The user's own data: calibration and validation samples, read and checked against the model.

Accuracy is judged on data the user cares about, and a sample that does not fit the model would
fail deep inside a build or, worse, be broadcast or cast into something else. So every array is
checked here, with a one-line message naming its file: its input name, its shape (exactly the
input's static shape) and its dtype (converted only where no value changes kind: a float64 image
to float32, int64 token ids to int32 when they fit). Files are numpy's own formats and are read
with ``allow_pickle=False``: a pickle runs whatever it was sent.

The forms accepted (a sample is a list of arrays in model input order):

- a folder of ``.npz`` files, one a sample, each holding an array per input name (any one array
  when the model has one input);
- a folder of ``.npy`` files, one a sample, when the model has one input;
- one ``.npz`` file holding, per input name, the samples stacked on a leading axis.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from pathlib import Path

import numpy as np

from partune.core import PartuneError, draw_like


def load_samples(
    path: str | Path,
    input_names: list[str],
    input_shapes: list[tuple[int, ...]],
    input_dtypes: list[str],
) -> list[list[np.ndarray]]:
    """The samples at ``path``, each a list of arrays in model input order, checked and cast to
    the inputs' dtypes. Folders are read in sorted file-name order."""
    path = Path(path)
    spec = _Inputs(input_names, [tuple(s) for s in input_shapes], input_dtypes)
    if not path.exists():
        raise PartuneError(f"{path}: no such file or folder of samples")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".npz") and p.is_file())
        if not files:
            raise PartuneError(f"{path}: the folder holds no .npy or .npz files")
        return [spec.sample(f, _read(f)) for f in files]
    if path.suffix != ".npz":
        raise PartuneError(
            f"{path}: expected a folder of .npy/.npz samples or one .npz file of stacked samples"
        )
    return spec.stacked(path, _read(path))


def _read(path: Path) -> dict[str, np.ndarray]:
    """Every array of a ``.npy`` (under the name "") or ``.npz`` file, read now: a corrupt member
    of an archive fails here, with its file named, not later."""
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.ndarray):
            return {"": data}
        with data:
            return {k: np.asarray(data[k]) for k in data.files}
    except ValueError as e:
        if "Object arrays" in str(e):
            raise PartuneError(
                f"{path}: holds Python objects, which are never unpickled (save plain arrays)"
            ) from e
        if "pickled" in str(e):
            raise PartuneError(
                f"{path}: not a .npy/.npz file (numpy would read it as a pickle, never loaded here)"
            ) from e
        raise PartuneError(f"{path}: cannot be read as numpy data: {_why(e)}") from e
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise PartuneError(f"{path}: cannot be read as numpy data: {_why(e)}") from e


def _why(e: Exception, limit: int = 120) -> str:
    """numpy's reason on one short printable line (a broken header quotes raw bytes)."""
    text = "".join(c if c.isprintable() else " " for c in str(e) or type(e).__name__)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Inputs:
    """The model's inputs, which every sample is checked against."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]], dtypes: list[str]):
        self.names, self.shapes, self.dtypes = names, shapes, dtypes

    def _by_name(self, f: Path, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The arrays in input order: by name, or the only one when the model has one input."""
        if len(self.names) == 1 and len(arrays) == 1:
            return list(arrays.values())
        if "" in arrays:
            raise PartuneError(
                f"{f}: a .npy file holds one array, but the model has {len(self.names)} inputs "
                f"({', '.join(self.names)}): save each sample as a .npz with an array per input"
            )
        missing = [n for n in self.names if n not in arrays]
        unknown = sorted(set(arrays) - set(self.names))
        if missing or unknown:
            said = [f"lacks input {', '.join(missing)}"] if missing else []
            said += [f"holds unknown name {', '.join(unknown)}"] if unknown else []
            raise PartuneError(
                f"{f}: {' and '.join(said)} (the model's inputs: {', '.join(self.names)})"
            )
        return [arrays[n] for n in self.names]

    def sample(self, f: Path, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One sample's arrays, checked and cast."""
        out = []
        for name, shape, dtype, a in zip(
            self.names, self.shapes, self.dtypes, self._by_name(f, arrays), strict=True
        ):
            if a.shape != shape:
                hint = " (a folder holds one sample a file)" if a.shape[1:] == shape else ""
                raise PartuneError(
                    f"{f}: input {name} has shape {a.shape}, the model takes {shape}{hint}"
                )
            out.append(_cast(f, name, a, dtype))
        return out

    def stacked(self, f: Path, arrays: dict[str, np.ndarray]) -> list[list[np.ndarray]]:
        """The samples of one ``.npz`` that stacks them on a leading axis."""
        ordered = self._by_name(f, arrays)
        for name, shape, a in zip(self.names, self.shapes, ordered, strict=True):
            if a.shape[1:] != shape or a.ndim != len(shape) + 1:
                want = "(N" + "".join(f", {d}" for d in shape) + ")"
                raise PartuneError(
                    f"{f}: input {name} has shape {a.shape}, expected {want}: the model's "
                    f"{shape} with the samples stacked on a leading axis"
                )
        counts = {name: len(a) for name, a in zip(self.names, ordered, strict=True)}
        if len(set(counts.values())) > 1:
            said = ", ".join(f"{n}: {c}" for n, c in counts.items())
            raise PartuneError(f"{f}: the inputs hold different numbers of samples ({said})")
        if not ordered or len(ordered[0]) == 0:
            raise PartuneError(f"{f}: holds no samples")
        casted = [
            _cast(f, n, a, d) for n, a, d in zip(self.names, ordered, self.dtypes, strict=True)
        ]
        return [[a[i] for a in casted] for i in range(len(casted[0]))]


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _cast(f: Path, name: str, a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` as ``dtype`` where that keeps every value: numpy's safe casts, a wider float to a
    narrower one that stays finite, and integers to integers within range; never a float to an
    integer, and a bool only to a bool."""
    want = _dtype(dtype)
    have = a.dtype
    if have == want:
        return a
    refused = f"{f}: input {name} is {have}, the model takes {want}"
    if (have.kind == "b") != (want.kind == "b"):
        raise PartuneError(f"{refused} (booleans only as booleans)")
    floats = np.issubdtype(want, np.floating) or want.name == "bfloat16"
    if np.issubdtype(have, np.integer) and np.issubdtype(want, np.integer):
        info = np.iinfo(want)
        if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
            raise PartuneError(f"{refused} (values beyond {want}'s range)")
        return a.astype(want)
    if np.issubdtype(have, np.floating) and floats:
        with np.errstate(over="ignore"):  # an overflow is refused just below
            out = a.astype(want)
        if not np.array_equal(np.isfinite(out.astype(np.float32)), np.isfinite(a)):
            raise PartuneError(f"{refused} (values beyond {want}'s range)")
        return out
    if np.can_cast(have, want, casting="safe"):
        return a.astype(want)
    raise PartuneError(f"{refused} (cast it yourself if that is meant)")


def split_samples(
    samples: list[list[np.ndarray]],
    validation: list[list[np.ndarray]] | None = None,
    held_out_share: float = 0.25,
) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]], str]:
    """(calibration, validation, a one-line note for the user). With no validation set, the last
    ``ceil(share * N)`` samples are held out (at least one, and one always left to calibrate):
    a plan judged on the samples it was chosen on would look better than it is. A single sample
    serves as both, and the note says so."""
    if not samples:
        raise PartuneError("no samples to calibrate on")
    if validation is not None:
        if not validation:
            raise PartuneError("the validation set holds no samples")
        note = f"{_count(len(samples))} to calibrate, {_count(len(validation))} given to validate"
        return samples, validation, note
    if not 0 < held_out_share < 1:
        raise PartuneError(f"held-out share {held_out_share} must lie between 0 and 1")
    n = len(samples)
    if n == 1:
        return samples, samples, "1 sample only: it serves both to calibrate and to validate"
    k = min(max(1, math.ceil(held_out_share * n)), n - 1)
    note = (
        f"{_count(n - k)} to calibrate, {_count(k)} to validate "
        f"(the last {k} of {n}, held out as no validation set was given)"
    )
    return samples[: n - k], samples[n - k :], note


def _count(n: int) -> str:
    return f"{n} sample" + ("" if n == 1 else "s")


def synthetic_samples(inputs: list[np.ndarray], count: int, seed: int) -> list[list[np.ndarray]]:
    """``count`` samples drawn like the model's own generated ``inputs`` (seeds ``seed``,
    ``seed + 1``, ...), for a user who gave no data: the same samples for the same seed."""
    return [draw_like(inputs, seed + i) for i in range(count)]
