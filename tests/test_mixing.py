"""Models mixed from the kept ones (``flcore.strategies.mixing``): ``keep_mixed`` keeps, in row order and under
the names given, the rows ``mixed_models`` computes, written and fingerprinted chunk by chunk as they are mixed,
over row groups and chunks that reuse two buffers, or named at random where no one checks them against a
fingerprint; a failed write keeps none of them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flcore.agent_models import Assignment, ModelBank, ModelWriter, Peers
from flcore.strategies import mixing
from flcore.strategies.base import Contribution
from models.weights import TensorSpec, fingerprint, unflatten

SPEC = (TensorSpec("a.weight", "float32", (300,)), TensorSpec("b.weight", "float32", (700,)))


@pytest.fixture
def small_passes(monkeypatch):
    monkeypatch.setattr(mixing, "CHUNK", 128)  # eight chunks a row, the last one short
    monkeypatch.setattr(mixing, "ROWS_AT_ONCE", 3)  # rows in groups of 3, 3 and 1


def views_and_weights() -> tuple[list[Contribution], np.ndarray]:
    rng = np.random.default_rng(3)
    views = [Contribution(f"a{i}", rng.standard_normal(1000).astype(np.float32), 1.0, 1.0, 0.0) for i in range(6)]
    return views, rng.random((7, 6))


def test_keep_mixed_keeps_every_row_under_its_name_and_fingerprint(tmp_path, small_passes):
    views, weights = views_and_weights()
    bank = ModelBank(tmp_path)
    counts = np.array([7], np.int64)  # an entry the fingerprint covers and the bank does not keep

    def slow_writer(owner: str) -> ModelWriter:
        writer = bank.writer(1, f"+{owner}", SPEC, {"count": counts})
        write = writer.write
        writer.write = lambda values: (time.sleep(0.001), write(values))  # the buffer must hold a chunk this long
        return writer

    names = [f"m{r}" for r in range(7)]
    holdings = mixing.keep_mixed(slow_writer, names, views, weights)
    assert [h.owner for h in holdings] == [f"+{n}" for n in names]
    want = [row.copy() for _, row in mixing.mixed_models(views, weights)]
    for holding, row in zip(holdings, want, strict=True):
        kept = bank.vector(holding)
        np.testing.assert_allclose(kept, row, rtol=1e-5, atol=1e-6)
        assert holding.sha256 == fingerprint({**unflatten(np.array(kept), SPEC), "count": counts})
    np.testing.assert_allclose(bank.vector(holdings[4]), weights[4] @ np.stack([v.delta for v in views]),
                               rtol=1e-5, atol=1e-6)


def test_a_model_kept_unfingerprinted_holds_the_same_values_under_a_random_name(tmp_path, small_passes):
    """FedAMP's cloud models beside each agent's own (``ModelBank.writer``): no one receives their exact bits."""
    views, weights = views_and_weights()
    bank = ModelBank(tmp_path)
    names = [f"m{r}" for r in range(7)]
    hashed = mixing.keep_mixed(bank.new_models(1, SPEC, {}), names, views, weights)
    named = mixing.keep_mixed(lambda name: bank.new_models(2, SPEC, {})(name, fingerprinted=False), names, views,
                              weights)  # fmt: skip
    again = mixing.keep_mixed(lambda name: bank.new_models(3, SPEC, {})(name, fingerprinted=False), names, views,
                              weights)  # fmt: skip
    for a, b, c in zip(hashed, named, again, strict=True):
        np.testing.assert_array_equal(bank.vector(a), bank.vector(b))
        assert a.sha256 == fingerprint(unflatten(np.array(bank.vector(b)), SPEC)) != b.sha256 != c.sha256
        assert len(b.sha256) == 64 and int(b.sha256, 16) >= 0
        assert a.fingerprinted and not b.fingerprinted
    assert len({h.sha256 for h in named + again}) == 14
    with pytest.raises(ValueError, match=r"\+m0's model of round 2 is named at random, not fingerprinted"):
        Assignment("inbox", named[0])  # a start model: its agent checks it against the task's fingerprint
    assert Assignment("local", hashed[0], Peers((named[0],), "bundle")).peers.models == (named[0],)


def test_a_failed_write_keeps_no_model_and_says_why(tmp_path, small_passes):
    views, weights = views_and_weights()
    bank = ModelBank(tmp_path)
    opened = []

    def failing_writer(owner: str) -> ModelWriter:
        writer = bank.writer(1, f"+{owner}", SPEC, {})
        opened.append(writer)
        if len(opened) == 5:  # the second group's second model: the disk is full
            def full(values: np.ndarray) -> None:
                raise OSError(28, "No space left on device")

            writer.write = full
        return writer

    with pytest.raises(OSError, match="No space left"):
        mixing.keep_mixed(failing_writer, [f"m{r}" for r in range(7)], views, weights)
    assert len(opened) == 6  # the third group was never started
    leftover = [p for p in (tmp_path / "r1").iterdir() if p.name.startswith(".")]
    assert leftover == []  # the failed group's temporary files are gone; the first group's models were kept
    assert sorted(p.name for p in (tmp_path / "r1").iterdir()) == [f"+m{r}.safetensors" for r in range(3)]


def test_a_failed_close_keeps_no_model_of_its_group(tmp_path, small_passes):
    views, weights = views_and_weights()
    bank = ModelBank(tmp_path)

    def writer(owner: str) -> ModelWriter:
        made = bank.writer(1, f"+{owner}", SPEC, {})
        if owner == "m1":
            def close() -> None:
                made.discard()
                raise OSError(5, "Input/output error")

            made.close = close
        return made

    with pytest.raises(OSError, match="Input/output"):
        mixing.keep_mixed(writer, [f"m{r}" for r in range(7)], views, weights)
    assert not [p for p in (tmp_path / "r1").iterdir() if p.name.startswith(".")]  # no temporary file left


def test_subnormal_weights_reach_the_kernels_as_zero_and_the_mix_stays_within_rounding(tmp_path, small_passes,
                                                                                        monkeypatch):  # fmt: skip
    """FedAMP's e^(−d²/σ) at d²/σ ≈ 92 is subnormal in float32, which x86 cores multiply on their slow path."""
    views, weights = views_and_weights()
    weights[:, ::2] = 1e-40
    seen: list[np.ndarray] = []
    matmul = np.matmul

    def spy(a, b, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - np.matmul's own signature
        seen.append(np.asarray(a).copy())
        return matmul(a, b, *args, **kwargs)

    monkeypatch.setattr(mixing.np, "matmul", spy)
    mixed = np.stack([row.copy() for _, row in mixing.mixed_models(views, weights)])
    mixing.keep_mixed(lambda owner: ModelBank(tmp_path).writer(1, f"+{owner}", SPEC, {}),
                      [f"m{r}" for r in range(len(weights))], views, weights)  # fmt: skip
    monkeypatch.undo()
    kernel_weights = np.concatenate([a.ravel() for a in seen])
    assert len(seen) > 2 and kernel_weights.dtype == np.float32
    assert not ((kernel_weights != 0) & (np.abs(kernel_weights) < np.finfo(np.float32).tiny)).any()
    reference = weights @ np.stack([v.delta for v in views]).astype(np.float64)
    np.testing.assert_allclose(mixed, reference, rtol=1e-5, atol=1e-5)
    assert (mixing.float32_weights(weights)[:, 1::2] == weights[:, 1::2].astype(np.float32)).all()
