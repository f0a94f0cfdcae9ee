"""Upsert the dashboard into a Grafana server with grafana-client, idempotently.

Auth from the environment: GRAFANA_TOKEN (service-account token, sent as a bearer token) or
GRAFANA_USER + GRAFANA_PASSWORD (basic auth). The folder is created once (found by uid after);
the dashboard is posted with overwrite, keyed by its uid, so running twice leaves one copy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grafana_client.api import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException

from serve_app.observability.dashboard import DATASOURCE_VAR, build_dashboard

FOLDER_UID = "serve-app"
FOLDER_TITLE = "serve-app"


class ProvisioningError(RuntimeError):
    pass


@dataclass(frozen=True)
class Provisioned:
    folder_uid: str
    dashboard_uid: str
    url: str


def credential_from_env(env: Mapping[str, str]) -> str | tuple[str, str] | None:
    if env.get("GRAFANA_TOKEN"):
        return env["GRAFANA_TOKEN"]
    if env.get("GRAFANA_USER") and env.get("GRAFANA_PASSWORD"):
        return (env["GRAFANA_USER"], env["GRAFANA_PASSWORD"])
    return None


def _ensure_folder(api: GrafanaApi) -> str:
    for folder in api.folder.get_all_folders():
        if folder.get("uid") == FOLDER_UID:
            return FOLDER_UID
    created: dict[str, Any] = api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
    return str(created.get("uid", FOLDER_UID))


def provision(
    url: str, datasource_uid: str, env: Mapping[str, str] | None = None, timeout_s: float = 10
) -> Provisioned:
    """Create the folder if missing and upsert the dashboard bound to the given datasource."""
    credential = credential_from_env(os.environ if env is None else env)
    api = GrafanaApi.from_url(url, credential=credential, timeout=timeout_s)
    dashboard = build_dashboard()
    for var in dashboard["templating"]["list"]:
        if var["name"] == DATASOURCE_VAR:
            var["current"] = {"text": datasource_uid, "value": datasource_uid}
    try:
        folder_uid = _ensure_folder(api)
        result = api.dashboard.update_dashboard(
            {"dashboard": dashboard, "folderUid": folder_uid, "overwrite": True}
        )
    except GrafanaClientError as e:
        hint = (
            " (check GRAFANA_TOKEN or GRAFANA_USER/GRAFANA_PASSWORD)"
            if e.status_code
            in (
                401,
                403,
            )
            else ""
        )
        raise ProvisioningError(f"Grafana refused the request: {e.status_code}{hint}") from None
    except GrafanaException as e:
        raise ProvisioningError(f"Grafana failed: {e.status_code} {e.message}"[:300]) from None
    except OSError as e:  # connection refused, DNS, TLS
        raise ProvisioningError(f"cannot reach Grafana at {url}: {e}") from None
    return Provisioned(folder_uid, dashboard["uid"], str(result.get("url", "")))
