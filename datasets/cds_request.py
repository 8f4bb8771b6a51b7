"""ERA5 from the Copernicus Climate Data Store (CDS) for a channel set, as files datasets/convert.py reads.

    python datasets/cds_request.py --channels nersc20 --years 2016 2017 --out DIR [--hours 0 6 12 18] [--dry-run]

One request per month and kind of level (ERA5 on single levels, ERA5 on pressure levels), each written to
``DIR/<single|pressure>-<year>-<month>.nc`` and skipped when that file is there (a rerun resumes). The
channel names are convert.py's (``nersc20``, ``superbench``, or names such as ``u10,t850,z500``), so the
download holds exactly what the conversion needs. Needs ``pip install cdsapi`` and a CDS account whose API
key is in ``~/.cdsapirc`` (the CDS's "How to API" page); ``--dry-run`` prints the requests and needs neither.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

if __package__:  # imported as datasets.cds_request
    from .compute_stats import OneLineParser
    from .convert import PRESETS
    from utils.data.foreign import ALIASES, DERIVED, LONG_NAMES
else:  # run as a script: datasets/ is on sys.path
    from compute_stats import OneLineParser
    from convert import PRESETS
    from utils.data.foreign import ALIASES, DERIVED, LONG_NAMES

try:  # optional: only the download needs it
    import cdsapi
except ImportError:
    cdsapi = None

SINGLE_LEVELS = ("u10", "v10", "u100", "v100", "t2m", "d2m", "sp", "msl", "tcwv", "sst", "tp")
DATASETS = {"single": "reanalysis-era5-single-levels", "pressure": "reanalysis-era5-pressure-levels"}


def variables(channels: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(single-level variables, pressure-level variables, pressure levels), as the CDS names them."""
    long = {short: name for name, short in LONG_NAMES.items()}
    single, upper, levels = [], [], []
    for channel in channels:
        for part in DERIVED[channel][0] if channel in DERIVED else (ALIASES.get(channel, channel),):
            part = LONG_NAMES.get(part, part)
            match = re.fullmatch(r"([a-z]+?)(\d+)", part)
            if part in SINGLE_LEVELS:
                single += [long[part]] if long[part] not in single else []
            elif match and match.group(1) in long and match.group(1) not in SINGLE_LEVELS:
                upper += [long[match.group(1)]] if long[match.group(1)] not in upper else []
                levels += [match.group(2)] if match.group(2) not in levels else []
            else:
                upper_names = ", ".join(v for v in sorted(long) if v not in SINGLE_LEVELS)
                raise ValueError(f"channel {channel}: not an ERA5 variable this script knows (single levels: "
                                 f"{', '.join(SINGLE_LEVELS)}; pressure levels of {upper_names})")
    return single, upper, sorted(levels, key=int)


def requests(channels: Sequence[str], years: Sequence[int], hours: Sequence[int]) -> list[tuple[str, str, dict]]:
    """(CDS data set, file name, request) per month and kind of level."""
    single, upper, levels = variables(channels)
    out = []
    for year in years:
        for month in range(1, 13):
            common = {"product_type": ["reanalysis"], "year": [str(year)], "month": [f"{month:02d}"],
                      "day": [f"{d:02d}" for d in range(1, 32)], "time": [f"{h:02d}:00" for h in hours],
                      "data_format": "netcdf", "download_format": "unarchived"}
            if single:
                out.append((DATASETS["single"], f"single-{year}-{month:02d}.nc", {**common, "variable": single}))
            if upper:
                out.append((DATASETS["pressure"], f"pressure-{year}-{month:02d}.nc",
                            {**common, "variable": upper, "pressure_level": levels}))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(prog="cds_request.py", description="ERA5 from the CDS for convert.py's channel names")
    parser.add_argument("--channels", required=True, help="nersc20, superbench, or names such as u10,t850,z500")
    parser.add_argument("--years", type=int, nargs="+", required=True)
    parser.add_argument("--hours", type=int, nargs="+", default=[0, 6, 12, 18], help="UTC hours of each day")
    parser.add_argument("--out", type=Path, required=True, help="folder for the netCDF files")
    parser.add_argument("--dry-run", action="store_true", help="print the requests; download nothing")
    args = parser.parse_args(argv)
    preset = PRESETS.get(args.channels.lower())
    names = [n for n, _ in preset] if preset else [n for n in re.split(r"[,\s]+", args.channels) if n]
    try:
        todo = requests(names, args.years, args.hours)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.dry_run:
        for dataset, name, request in todo:
            print(f"{args.out / name}: {dataset} {json.dumps(request)}")
        return 0
    if cdsapi is None:
        parser.exit(2, f"{parser.prog}: error: cdsapi is not installed; pip install cdsapi (key: ~/.cdsapirc)\n")
    args.out.mkdir(parents=True, exist_ok=True)
    client = cdsapi.Client()
    for dataset, name, request in todo:
        target = args.out / name
        if not target.exists():  # downloaded under another name, renamed when complete: a rerun resumes
            client.retrieve(dataset, request, str(target.with_suffix(".partial")))
            target.with_suffix(".partial").rename(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
