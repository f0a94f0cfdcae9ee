"""`python -m serve_app.observability write|check|provision`: the Grafana dashboard as code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serve_app.constants import PACKAGE_DIR
from serve_app.observability.dashboard import dashboard_json

DEFAULT_PATH = PACKAGE_DIR.parent / "cluster" / "grafana" / "dashboards" / "serve-app.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.observability", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="write the dashboard JSON")
    write.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    check = sub.add_parser("check", help="fail if the committed JSON is not current")
    check.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    prov = sub.add_parser("provision", help="upsert the dashboard into Grafana")
    prov.add_argument("--url", required=True, help="Grafana base URL")
    prov.add_argument("--datasource-uid", default="prometheus")
    args = parser.parse_args(argv)

    if args.command == "write":
        args.path.parent.mkdir(parents=True, exist_ok=True)
        args.path.write_text(dashboard_json())
        print(f"wrote {args.path}")
        return 0
    if args.command == "check":
        current = args.path.read_text() if args.path.exists() else ""
        if current != dashboard_json():
            print(f"{args.path} is stale: run `python -m serve_app.observability write`")
            return 1
        print(f"{args.path} is current")
        return 0
    from serve_app.observability.provision import ProvisioningError, provision

    try:
        done = provision(args.url, args.datasource_uid)
    except ProvisioningError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"dashboard {done.dashboard_uid} in folder {done.folder_uid}: {done.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
