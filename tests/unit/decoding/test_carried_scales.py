"""The cost corrections a round loop carries from its latest rounds to new requests, per load band
(crossdraft.decoding.costmodel.CarriedScales): pure bookkeeping, no models."""

from __future__ import annotations

from crossdraft.decoding.costmodel import CarriedScales, load_band

ALONE = (1.4, 1.4, 1.0, 0.0, 1.0, 1.0)
BUSY = (2.5, 1.2, 1.0, 0.0, 0.9, 0.6)


def test_bands_are_alone_then_one_per_doubling():
    assert load_band(1.0) == load_band(1.4) == 0
    bands = [load_band(x) for x in (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)]
    assert bands == sorted(bands) and bands[0] == 1
    assert load_band(2.0) < load_band(4.0) < load_band(8.0) < load_band(16.0) < load_band(32.0)
    assert load_band(2.9) == load_band(1.6) and load_band(5.9) == load_band(3.1)


def test_a_request_starts_from_what_was_measured_at_its_load():
    c = CarriedScales()
    assert c.get("same", 1.0) is None
    c.put("same", 1.0, ALONE)
    c.put("same", 4.0, BUSY)
    assert c.get("same", 1.0) == ALONE and c.get("same", 1.2) == ALONE
    assert c.get("same", 4.0) == BUSY and c.get("same", 3.5) == BUSY
    # the quiet spell after the busy one does not overwrite what the busy one measured
    c.put("same", 1.0, (1.3, 1.3, 1.0, 0.0, 1.0, 1.0))
    assert c.get("same", 4.0) == BUSY
    assert c.get("text", 4.0) is None  # modes apart


def test_an_unmeasured_load_starts_from_the_nearest_measured_the_busier_on_a_tie():
    c = CarriedScales()
    c.put("same", 1.0, ALONE)
    assert c.get("same", 16.0) == ALONE  # nothing else measured yet
    c.put("same", 16.0, BUSY)
    assert c.get("same", 8.0) == BUSY and c.get("same", 2.0) == ALONE
    two_away = [x for x in (2.0, 4.0, 8.0) if abs(load_band(x) - load_band(1.0)) == abs(load_band(x) - load_band(16.0))]
    assert two_away and all(c.get("same", x) == BUSY for x in two_away)
    assert sorted(c.values()) == sorted([ALONE, BUSY])
    c.clear()
    assert c.get("same", 1.0) is None
