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


def test_streamed_floats_are_hashed_and_kept_as_the_model_holds_them():
    """A float16 or float64 entry travels as float32 in the stream: hashed in its own dtype (a float16 one rounded,
    and kept rounded), a 0-d entry as ``fingerprint`` sees it, so the agent that gets the model names it alike."""
    model = {"half": np.zeros(4, np.float16), "scale": np.array(2.0, np.float32), "wide": np.zeros(3, np.float64)}
    spec = spec_of({name: np.asarray(a, np.float32) for name, a in model.items()})
    vector = np.array([0.1, 0.2, 1e-5, 7.0, 3.5, 0.3, 0.6, 0.9], np.float32)
    streamed = Fingerprinter(model, spec)
    held = np.concatenate(streamed.update(vector[:3]) + streamed.update(vector[3:]))
    assert streamed.hexdigest() == fingerprint(with_floats(model, vector, spec))
    np.testing.assert_array_equal(held[:4], vector[:4].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(held[4:], vector[4:])
