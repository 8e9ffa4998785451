"""One table from several benchmark JSON files (runs of scripts/bench.py on the same machine).

    python scripts/bench_report.py scripts/results/cpu/*.json

Prints the rows of every file in the order given (a workload measured twice appears twice),
then the ratios of each file, and the machine each file ran on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import markdown_table, ratios_table  # noqa: E402


def main(paths: list[str]) -> str:
    reports = [json.loads(Path(path).read_text()) for path in paths]
    rows = [row for report in reports for row in report["rows"]]
    ratios = [f"{path}:\n{ratios_table(report['ratios'])}" for path, report in zip(paths, reports)]
    machines = sorted({json.dumps(report["machine"], sort_keys=True) for report in reports})
    text = f"{markdown_table(rows)}\n\n" + "\n\n".join(ratios) + "\n\nmachine: " + "\nmachine: ".join(machines)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
