"""Answers' JSON: orjson's text and json.dumps' parse to the same floats (btlib.serve.bodies.to_json)."""

import json

import numpy as np
import pytest

from btlib.serve.extras import missing

pytestmark = pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))


def float32_rows() -> np.ndarray:
    """(8, 384) float32: normal draws, then the edges a row can hold (subnormals, the extremes, -0, 1 - ulp)."""
    rows = np.random.default_rng(0).standard_normal((8, 384)).astype(np.float32)
    f = np.finfo(np.float32)
    edges = [f.tiny, f.smallest_subnormal, f.max, -f.max, f.eps, -0.0, 0.0, np.nextafter(np.float32(1), np.float32(0)),
             1 / 3, 0.1, 1e-38, 3.4e38]
    rows[0, :len(edges)] = np.array(edges, dtype=np.float32)
    return rows


def test_orjson_and_json_answers_parse_to_identical_float32_rows():
    from btlib.serve import bodies

    pytest.importorskip("orjson")
    rows = float32_rows()
    obj = {"data": [{"embedding": r.tolist()} for r in rows]}  # the shape /v1/embeddings writes
    fast, plain = bodies.to_json(obj), bodies.to_json(obj, fast=False)
    assert fast != plain  # two writers (orjson has no spaces), so the comparison below compares two texts
    got = [np.array([d["embedding"] for d in json.loads(t)["data"]]) for t in (fast, plain)]
    assert np.array_equal(got[0], got[1])  # the same float64 values
    for g in got:
        assert np.array_equal(g.astype(np.float32), rows) and np.array_equal(np.signbit(g), np.signbit(rows))


def test_without_orjson_the_json_path_answers(monkeypatch):
    import asyncio

    from btlib.serve import bodies

    monkeypatch.setattr(bodies, "orjson", None)
    rows = float32_rows()
    for big in (False, True):
        text = asyncio.run(bodies.dumps(rows.tolist(), big))
        assert text == json.dumps(rows.tolist()).encode()
        assert np.array_equal(np.array(json.loads(text), dtype=np.float32), rows)
