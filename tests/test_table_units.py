"""Tables show each memory column in the unit its values call for; the rows (what gets recorded) keep raw numbers."""
import pytest

from labutils.core.results import adapt_byte_units, byte_unit, format_table

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize("values, unit", [
    ([11.6 * MiB, 11.5 * MiB], "MiB"),
    ([3 * GiB, 5 * GiB], "GiB"),
    ([512 * MiB, 3 * GiB], "MiB"),          # the smallest value decides: 512 MiB, not 0.5 GiB
    ([-2 * MiB, 4 * MiB], "MiB"),           # signed differences use the magnitude
    ([100, 2048], "B"),
    ([0, None, float("nan"), 3 * 1024], "KiB"),
    ([0, None], "B"),
])
def test_byte_unit_follows_the_smallest_nonzero_magnitude(values, unit):
    assert byte_unit(values)[0] == unit


def test_a_gib_column_of_small_values_is_shown_in_mib_and_renamed():
    rows = [{"run": "fp32", "peak_gib": 11.6 * MiB / GiB}, {"run": "bf16", "peak_gib": 11.5 * MiB / GiB}]
    text = format_table(rows)
    assert text.splitlines()[0] == "| run | peak_mib |"
    assert "| fp32 | 11.6 |" in text and "| bf16 | 11.5 |" in text
    assert rows[0]["peak_gib"] == pytest.approx(11.6 / 1024)  # the recorded rows are not touched
    assert "0.0113" in format_table(rows, adapt_units=False)


@pytest.mark.parametrize("column, values, shown", [
    ("allocated (MiB)", [3072.0, 4096.0], "allocated (GiB)"),
    ("memory [GiB]", [0.25], "memory [MiB]"),
    ("MiB", [0.5], "KiB"),
    ("weights_bytes", [5 * GiB], "weights_gib"),
    ("weights_bytes", [300], "weights_bytes"),
])
def test_unit_suffix_forms(column, values, shown):
    rows, columns = adapt_byte_units([{column: v} for v in values], [column])
    assert columns == [shown]
    assert all(shown in r for r in rows)


def test_columns_without_a_byte_unit_are_left_alone():
    rows = [{"KiB_per_token": 3.0, "saving_pct": 12.0, "micro_batch": 4, "peak memory": "1.00 GiB"}]
    out, columns = adapt_byte_units(rows, list(rows[0]))
    assert columns == list(rows[0]) and out == rows


def test_missing_values_stay_missing():
    rows, columns = adapt_byte_units([{"peak_mib": None}, {"peak_mib": 2048.0}], ["peak_mib"])
    assert columns == ["peak_gib"] and rows[0]["peak_gib"] is None and rows[1]["peak_gib"] == 2.0
