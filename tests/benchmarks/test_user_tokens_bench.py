"""The user-token benchmark runs and reports each key type the memory service takes."""

from __future__ import annotations

from benchmarks.user_tokens import KEYS, main


def test_the_benchmark_reports_a_first_and_a_remembered_check_per_key_type(capsys) -> None:
    main(["--tokens", "3", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(KEYS)
    for row in rows:
        first, again = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert first > again > 0  # a remembered token skips the signature check
