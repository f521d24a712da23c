"""The stream benchmark's efficiency: the floor is the fastest movement of one pass's bytes seen in
the run, so a pass can reach 1 and never pass it (the old definition, a raw read against a pass
whose next pass was partly prefetched, scored 1.15-1.31)."""

from benchmarks.stream_bench import efficiency_row


def test_efficiency_is_floor_over_pass_and_never_above_one():
    row = efficiency_row(16, raws=[0.25, 0.22, 0.30], nulls=[0.19, 0.21], passes=[0.24, 0.26, 0.20],
                         measured_bytes=4.2e8, floor_s=0.5)
    assert row["floor_seconds"] == 0.19  # the null pass was the fastest movement in the run
    assert row["pass_seconds"] == 0.24 and row["raw_read_seconds"] == 0.22
    assert row["efficiency"] == 0.19 / 0.24
    fast = efficiency_row(1, raws=[0.3], nulls=[0.3], passes=[0.1, 0.1, 0.1], measured_bytes=1.0, floor_s=0.4)
    assert fast["efficiency"] == 1.0  # a pass faster than every raw read defines the floor itself
    assert efficiency_row(1, [0.2], [0.2], [0.25], 1.0, floor_s=0.05)["efficiency"] == 0.05 / 0.25  # run-wide floor
