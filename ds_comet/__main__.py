"""python -m ds_comet report [--config ds_config.json]"""

import sys

from .report import main as report_main


def main():
    if len(sys.argv) < 2 or sys.argv[1] != "report":
        sys.exit(
            "usage: python -m ds_comet report [--config ds_config.json]   (the benchmark is python -m ds_comet.bench)"
        )
    report_main(sys.argv[2:])


main()
