"""``models.weights.Fingerprinter``: a model's fingerprint from its floats streamed in any pieces equals
``fingerprint`` of the whole model, integer buffers between the float tensors included; a short or long stream,
or floats out of name order, is refused."""

from __future__ import annotations

import numpy as np
import pytest

from models.weights import Fingerprinter, TensorSpec, fingerprint, flatten, float_part, spec_of, with_floats

MODEL = {
    "bn.num_batches_tracked": np.array(12, np.int64),
    "bn.running_mean": np.linspace(-1, 1, 5, dtype=np.float32),
    "conv.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2),
    "empty.bias": np.zeros(0, np.float32),
    "head.bias": np.ones(3, np.float32),
    "z.steps": np.array([3, 4], np.int32),
}


@pytest.mark.parametrize("piece", [1, 7, 29, 1000])
def test_streamed_floats_give_the_whole_models_fingerprint(piece):
    spec = spec_of(float_part(MODEL))
    vector = flatten(MODEL, spec) * np.float32(1.5)
    streamed = Fingerprinter(MODEL, spec)
    for start in range(0, vector.size, piece):
        streamed.update(vector[start : start + piece])
    assert streamed.hexdigest() == fingerprint(with_floats(MODEL, vector, spec))
    assert Fingerprinter(MODEL).hexdigest() == fingerprint(MODEL)


def test_a_stream_that_does_not_fit_the_spec_is_refused():
    spec = (TensorSpec("a", "float32", (3,)),)
    short = Fingerprinter({}, spec)
    short.update(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="1 values .* never came"):
        short.hexdigest()
    with pytest.raises(ValueError, match="more values"):
        Fingerprinter({}, spec).update(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="float32 values, not float64"):
        Fingerprinter({}, spec).update(np.ones(3))
    with pytest.raises(ValueError, match="name order"):
        Fingerprinter({}, (TensorSpec("b", "float32", (1,)), TensorSpec("a", "float32", (1,))))
