"""GET /metrics: TEI's te_* histograms and counters beside btlib's own, parsed from the text a scraper reads."""

import re
from collections import defaultdict

import pytest

from btlib.serve.extras import missing
from btlib.serve.metrics import Histogram
from model_folder import needs_model
from serve_helpers import client_of, running_app

TESTED_HERE = ["btlib.serve.metrics"]

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> name -> {sorted label pairs: value}; every line a comment or a sample."""
    out = defaultdict(dict)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        out[m.group(1)][labels] = float(m.group(3))
    return out


def histograms(samples: dict) -> dict[str, tuple[list[float], float, float]]:
    """name -> (cumulative bucket counts in le order, _sum, _count)."""
    out = {}
    for name in samples:
        if name.endswith("_bucket"):
            base = name[:-len("_bucket")]
            by_le = sorted(((float(dict(k)["le"]), v) for k, v in samples[name].items()))
            out[base] = ([v for _, v in by_le], samples[base + "_sum"][()], samples[base + "_count"][()])
    return out


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    h = Histogram((1, 2, 5))
    for v in (0.5, 1, 2, 3, 7):
        h.observe(v)
    lines = h.lines("x", "help")
    assert lines[2:] == ['x_bucket{le="1"} 2', 'x_bucket{le="2"} 3', 'x_bucket{le="5"} 4', 'x_bucket{le="+Inf"} 5',
                         "x_sum 13.5", "x_count 5"]


@needs_model
@pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))
def test_metrics_count_every_request_by_route_and_status(model):
    with running_app(model) as server, client_of(server) as c:
        for i in range(3):
            assert c.post("/embed", json={"inputs": [f"query {i}", "a second text"]}).status_code == 200
        for i in range(2):
            assert c.post("/v1/embeddings", json={"input": f"text {i}"}).status_code == 200
        assert c.post("/embed", json={"inputs": "x", "unknown_field": 1}).status_code == 422
        assert c.post("/embed", json={"inputs": ["w"] * 257}).status_code == 413  # past --max-inputs 256
        assert c.post("/no_such_route", json={}).status_code == 404
        samples = parse(c.get("/metrics").text)
    hist = histograms(samples)
    te = {"te_request_duration", "te_request_tokenization_duration", "te_request_queue_duration",
          "te_request_inference_duration", "te_request_input_length", "te_batch_next_size", "te_batch_next_tokens"}
    assert te <= set(hist)
    for name, (buckets, total, count) in hist.items():
        assert buckets == sorted(buckets) and buckets[-1] == count, name  # monotone, +Inf = _count
        assert total >= 0
    for name in te - {"te_batch_next_size", "te_batch_next_tokens"}:
        assert hist[name][2] == 5, name  # the five requests that ran the model
    assert hist["te_batch_next_size"][2] == samples["btlib_serve_batches_total"][()]
    assert hist["te_batch_next_size"][1] == samples["btlib_serve_texts_total"][()] == 8
    count = samples["te_request_count"]
    assert count[(("method", "embed"), ("status", "200"))] == 3
    assert count[(("method", "v1_embeddings"), ("status", "200"))] == 2
    assert count[(("method", "embed"), ("status", "422"))] == 1
    assert count[(("method", "embed"), ("status", "413"))] == 1
    assert count[(("method", "other"), ("status", "404"))] == 1
    success = {k: v for k, v in samples["te_request_success"].items() if v}  # a route that only failed reads 0
    assert success == {(("method", "embed"),): 3, (("method", "v1_embeddings"),): 2}
    failure = samples["te_request_failure"]
    assert failure[(("err", "validation"), ("method", "embed"), ("status", "422"))] == 1
    assert failure[(("err", "validation"), ("method", "embed"), ("status", "413"))] == 1
    assert samples["te_queue_size"][()] == 0
    assert samples["btlib_serve_requests_total"][()] == 5  # btlib's own metrics stay
