from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from decimal import ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest

from edge_agent.metrics import ExponentialHistogram, bucket_index, relative_error


def exact_index(value: float, scale: int) -> int:
    """Reference bucket index from exact rational arithmetic: base**i < value <= base**(i+1)."""
    v = Fraction(value)
    if scale <= 0:
        # base**i = 2**(i * 2**-s): walk from the binary exponent
        width = 1 << -scale
        i = (math.frexp(value)[1] - 1) // width + 1
        while Fraction(2) ** (i * width) >= v:
            i -= 1
        while Fraction(2) ** ((i + 1) * width) < v:
            i += 1
        return i
    # v > 2**(i / 2**s)  <=>  v**(2**s) > 2**i
    power = v ** (1 << scale)
    i = math.floor(math.log2(value) * (1 << scale)) + 2
    while Fraction(2) ** i >= power:
        i -= 1
    return i


def decimal_index(value: float, scale: int) -> int:
    """Reference for high scales, where exact powers get large: 80-digit logarithms."""
    with localcontext() as ctx:
        ctx.prec = 80
        x = Decimal(value).ln() / Decimal(2).ln() * (1 << scale)
        if x == x.to_integral_value():  # a power of two: the boundary belongs to the lower bucket
            return int(x) - 1
        return int(x.to_integral_value(rounding=ROUND_FLOOR))


def lognormal(seed: int, median_ms: float, sigma: float, n: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(median_ms * np.exp(sigma * rng.standard_normal(n)))


@pytest.mark.parametrize(
    "value, scale, expected",
    [
        # Powers of two are upper-inclusive boundaries: 2**k ends bucket k*2**s - 1.
        (1.0, 0, -1),
        (2.0, 0, 0),
        (4.0, 0, 1),
        (0.5, 0, -2),
        (3.0, 0, 1),
        (1.0, 3, -1),
        (2.0, 3, 7),
        (2.0, 1, 1),
        (1024.0, 4, 159),
        (2.0**-20, 2, -81),
        # Negative scales: base 4 at -1, base 16 at -2.
        (4.0, -1, 0),
        (1.0, -1, -1),
        (2.0, -1, 0),
        (5.0, -1, 1),
        (16.0, -2, 0),
        (17.0, -2, 1),
        # sqrt(2) is the boundary between buckets 0 and 1 at scale 1; the float is just above it.
        (math.sqrt(2), 1, 1),
        (math.nextafter(math.sqrt(2), 0), 1, 0),
        (5e-324, 0, -1075),
        (1.7976931348623157e308, 0, 1023),
        (1.7976931348623157e308, -10, 0),
    ],
)
def test_bucket_index_at_boundaries(value, scale, expected):
    assert bucket_index(value, scale) == expected == exact_index(value, scale)


def test_bucket_index_matches_exact_arithmetic_near_every_boundary():
    rnd = random.Random(7)
    values = [math.exp(rnd.uniform(-12, 12)) for _ in range(400)]
    for scale in range(-4, 7):
        for i in range(-40, 40, 3):
            # the float nearest each bucket boundary and its neighbours: where log() goes off by one
            b = 2.0 ** (i / 2.0**scale)
            values += [math.nextafter(b, 0), b, math.nextafter(b, math.inf)]
        for v in values:
            assert bucket_index(v, scale) == exact_index(v, scale), (v, scale)


@pytest.mark.parametrize("scale", [10, 16, 20])
def test_bucket_index_at_high_scales_matches_high_precision_logarithms(scale):
    rnd = random.Random(scale)
    for _ in range(300):
        i = rnd.randint(-(30 << scale), 30 << scale)
        b = 2.0 ** (i / 2.0**scale)
        for v in (math.nextafter(b, 0), b, math.nextafter(b, math.inf), b * (1 + rnd.random() * 1e-6)):
            assert bucket_index(v, scale) == decimal_index(v, scale), (v, scale)


@pytest.mark.parametrize("scale, expected", [(3, 0.0433), (4, 0.02166), (5, 0.01083), (0, 1 / 3), (-10, 1.0)])
def test_relative_error_is_base_minus_one_over_base_plus_one(scale, expected):
    assert relative_error(scale) == pytest.approx(expected, rel=1e-3)
    # (base - 1) / (base + 1) == tanh(ln(base) / 2)
    assert relative_error(scale) == pytest.approx(math.tanh(math.log(2) * 2.0**-scale / 2), rel=1e-12)


def bimodal(seed: int, n: int) -> list[float]:
    fast, slow = lognormal(seed, 40.0, 0.2, n - n // 5), lognormal(seed + 1, 450.0, 0.3, n // 5)
    return fast + slow


@pytest.mark.parametrize(
    "name, values",
    [
        ("lognormal", lognormal(1, 180.0, 0.5, 5000)),
        ("heavy-tail", lognormal(2, 60.0, 1.3, 5000)),
        ("bimodal", bimodal(3, 5000)),
        ("with zeros", [0.0] * 300 + lognormal(4, 20.0, 0.8, 3000)),
        ("few", [12.0, 13.5, 700.0]),
    ],
)
@pytest.mark.parametrize("max_size", [160, 40])
def test_quantiles_within_documented_error_of_numpy(name, values, max_size):
    hist = ExponentialHistogram(max_size)
    hist.record_many(values)
    assert hist.count == len(values) and hist.sum == sum(values)
    assert hist.min == min(values) and hist.max == max(values)
    assert len(hist.bucket_counts) <= max_size
    for q in (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0):
        truth = float(np.quantile(values, q, method="inverted_cdf"))
        estimate = hist.quantile(q)
        if truth == 0.0:
            assert estimate == 0.0
        else:
            assert abs(estimate - truth) / truth <= hist.relative_error + 1e-12, (name, q)


def test_fleet_p99_from_merged_histograms_vs_mean_of_device_p99s():
    # Three healthy devices and one degraded one.
    devices = [lognormal(10 + d, 130.0, 0.3, 4000) for d in range(3)]
    devices.append(lognormal(20, 330.0, 0.35, 4000))
    hists = []
    for samples in devices:
        hist = ExponentialHistogram()
        hist.record_many(samples)
        # what each device would ship over MQTT
        hists.append(ExponentialHistogram.from_dict(json.loads(json.dumps(hist.to_dict()))))
    fleet = ExponentialHistogram()
    for hist in hists:
        fleet.merge(hist)

    pooled = [v for samples in devices for v in samples]
    true_p99 = float(np.percentile(pooled, 99, method="inverted_cdf"))
    mean_of_p99s = float(np.mean([np.percentile(s, 99, method="inverted_cdf") for s in devices]))
    assert abs(fleet.quantile(0.99) - true_p99) / true_p99 <= fleet.relative_error
    assert abs(mean_of_p99s - true_p99) / true_p99 > 0.15  # averaging percentiles is far off
    assert fleet.count == len(pooled) and fleet.sum == pytest.approx(sum(pooled), rel=1e-12)

    # Merging is exact: the same buckets as recording the pooled samples on one histogram,
    # whatever the order of the merges.
    direct = ExponentialHistogram()
    direct.record_many(pooled)
    backwards = ExponentialHistogram()
    for hist in reversed(hists):
        backwards.merge(hist)
    for merged in (fleet, backwards):
        assert (merged.scale, merged.offset, merged.bucket_counts) == (
            direct.scale,
            direct.offset,
            direct.bucket_counts,
        )


@pytest.mark.parametrize(
    "a, b, max_size",
    [
        (lognormal(1, 10.0, 0.05, 500), lognormal(2, 1000.0, 0.05, 500), 160),  # far apart: downscale more
        (lognormal(3, 50.0, 0.01, 500), lognormal(4, 50.0, 1.0, 500), 160),  # scale 20-ish vs scale 3-ish
        (lognormal(5, 5.0, 0.5, 300), lognormal(6, 5.0, 0.5, 300), 8),
        ([0.0, 0.0], lognormal(7, 3.0, 0.2, 50), 160),  # zeros only: no buckets, keeps the other's scale
        ([], lognormal(8, 3.0, 0.2, 50), 160),
    ],
)
def test_merge_at_different_scales_is_exact(a, b, max_size):
    ha, hb = ExponentialHistogram(max_size), ExponentialHistogram(max_size)
    ha.record_many(a)
    hb.record_many(b)
    direct = ExponentialHistogram(max_size)
    direct.record_many(a + b)
    ha.merge(hb)
    assert ha.scale == direct.scale
    assert (ha.offset, ha.bucket_counts, ha.zero_count) == (direct.offset, direct.bucket_counts, direct.zero_count)
    assert ha.count == len(a) + len(b) and ha.min == direct.min and ha.max == direct.max


def test_merge_self_doubles_and_refuses_other_zero_threshold():
    hist = ExponentialHistogram()
    hist.record_many([1.0, 2.0, 3.0])
    hist.merge(hist)
    assert hist.count == 6 and sum(hist.bucket_counts) == 6 and hist.sum == 12.0
    with pytest.raises(ValueError, match="zero_threshold"):
        hist.merge(ExponentialHistogram(zero_threshold=0.5))


@pytest.mark.parametrize("max_size", [3, 5, 20, 160])
def test_downscaling_keeps_count_sum_min_max_exact(max_size):
    rnd = random.Random(max_size)
    values = [10 ** rnd.uniform(-3, 6) for _ in range(3000)]
    hist = ExponentialHistogram(max_size)
    hist.record_many(values)
    assert len(hist.bucket_counts) <= max_size
    assert hist.count == len(values) == sum(hist.bucket_counts)
    assert hist.sum == sum(values)  # same additions in the same order
    assert (hist.min, hist.max) == (min(values), max(values))
    # downscaling equals bucketing every value directly at the final scale
    direct = Counter(bucket_index(v, hist.scale) for v in values)
    assert {hist.offset + k: c for k, c in enumerate(hist.bucket_counts) if c} == dict(direct)


@pytest.mark.parametrize("bad", [-1.0, -1e-300, math.nan, math.inf, -math.inf, "5", True, None])
def test_record_rejects_values_that_are_not_latencies(bad):
    hist = ExponentialHistogram()
    with pytest.raises(ValueError, match=r"latency must be .*" + re.escape(repr(bad))):
        hist.record(bad)
    assert hist.count == 0


def test_quantile_arguments_and_empty_histogram():
    hist = ExponentialHistogram()
    assert hist.quantile(0.5) is None and hist.min is None
    hist.record(5)
    assert hist.quantile(0.5) == 5.0 and isinstance(hist.to_dict()["min"], float)
    for q in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="quantile"):
            hist.quantile(q)


def filled(values, **kwargs) -> ExponentialHistogram:
    hist = ExponentialHistogram(**kwargs)
    hist.record_many(values)
    return hist


@pytest.mark.parametrize(
    "hist",
    [
        ExponentialHistogram(),
        filled([0.0, 0.0]),
        filled(lognormal(1, 100.0, 0.7, 2000)),
        filled(lognormal(2, 100.0, 0.7, 2000), max_size=10),
        filled([0.0, 0.1, 0.3, 5.0], zero_threshold=0.2),
    ],
)
def test_to_dict_from_dict_round_trip(hist):
    wire = json.loads(json.dumps(hist.to_dict()))
    assert set(wire) >= {"scale", "zeroCount", "zeroThreshold", "positive", "count", "sum"}
    back = ExponentialHistogram.from_dict(wire)
    assert back == hist and back.to_dict() == hist.to_dict()
    assert back.quantile(0.99) == hist.quantile(0.99)


def test_from_dict_reads_proto3_json_forms():
    # 64-bit integers as strings, default fields omitted, unknown OTLP fields present
    hist = ExponentialHistogram.from_dict(
        {
            "count": "3",
            "sum": 7.5,
            "scale": 1,
            "positive": {"offset": 2, "bucketCounts": ["0", "2", "1", "0"]},
            "startTimeUnixNano": "1",
            "attributes": [],
            "min": 2.1,
            "max": 3.0,
        }
    )
    assert (hist.count, hist.zero_count, hist.offset, hist.bucket_counts) == (3, 0, 3, (2, 1))
    assert ExponentialHistogram.from_dict({}).count == 0
    no_bounds = ExponentialHistogram.from_dict({"count": 2, "sum": 3.0, "positive": {"bucketCounts": [2]}})
    assert no_bounds.min is None and "min" not in no_bounds.to_dict() and no_bounds.quantile(0.5) > 1.0
    small = ExponentialHistogram.from_dict(filled(lognormal(3, 9.0, 1.0, 500)).to_dict(), max_size=8)
    assert len(small.bucket_counts) <= 8 and small.count == 500


def good() -> dict:
    return filled([0.0, 1.0, 2.5, 40.0]).to_dict()


def edit(**changes):
    def make():
        data = good()
        for key, value in changes.items():
            if key.startswith("positive_"):
                data["positive"][key.removeprefix("positive_")] = value
            elif value is ...:
                del data[key]
            else:
                data[key] = value
        return data

    return make


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: [1, 2], "histogram:"),
        (lambda: "scale", "histogram:"),
        (edit(scale="x"), "'scale'"),
        (edit(scale=21), "'scale'"),
        (edit(scale=True), "'scale'"),
        (edit(scale=1.5), "'scale'"),
        (edit(zeroCount=-1), "'zeroCount'"),
        (edit(zeroCount=[1]), "'zeroCount'"),
        (edit(count=99), "'count'"),
        (edit(count="3x"), "'count'"),
        (edit(positive=[1, 2]), "'positive'"),
        (edit(positive_bucketCounts="1,2"), "'positive.bucketCounts'"),
        (edit(positive_bucketCounts=[1, -2]), "'positive.bucketCounts[1]'"),
        (edit(positive_bucketCounts=[1, 1.5]), "'positive.bucketCounts[1]'"),
        (edit(positive_bucketCounts=[1] * 70000), "'positive.bucketCounts'"),
        (edit(positive_offset="a"), "'positive.offset'"),
        (edit(positive_offset=2**40), "'positive.offset'"),
        (edit(sum=math.nan), "'sum'"),
        (edit(sum="Infinity"), "'sum'"),
        (edit(sum=-1.0), "'sum'"),
        (edit(sum=10**400), "'sum'"),
        (edit(sum=...), "'sum'"),
        (edit(min=50.0), "'min'"),
        (edit(max=-1), "'max'"),
        (edit(max={}), "'max'"),
        (edit(zeroThreshold=math.inf), "'zeroThreshold'"),
        (edit(negative={"offset": 0, "bucketCounts": [1]}), "'negative'"),
    ],
)
def test_from_dict_rejects_malformed_input_naming_the_field(make, field):
    with pytest.raises(ValueError) as err:
        ExponentialHistogram.from_dict(make())
    assert field in str(err.value)


def test_constructor_validation():
    for kwargs in ({"max_size": 2}, {"max_scale": 21}, {"zero_threshold": -1.0}, {"zero_threshold": math.nan}):
        with pytest.raises(ValueError):
            ExponentialHistogram(**kwargs)
