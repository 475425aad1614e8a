"""The Kubernetes API from inside a pod, with the pod's service account (plain HTTPS: the image has no
`kubernetes` client). `environment.pod_image` reads the pod's own image digest through it, `driver.follow` tells
the run's story on its RayJob."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Mapping

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ApiError(Exception):
    """A request that did not succeed: `status` is the HTTP status, None when no answer came; `retry` whether
    asking again may help (no answer, a server error, throttling; not a refusal, a missing token or API server)."""

    def __init__(self, message: str, status: int | None = None, retry: bool = False):
        super().__init__(message)
        self.status, self.retry = status, retry


@dataclass
class InCluster:
    """Where the API server is and how to authenticate: `url`, the service-account `token_path` (read at each
    request: a projected token is rotated under a long run) and `ca_path` (None: the system's CAs)."""

    url: str
    token_path: str = os.path.join(SERVICE_ACCOUNT_DIR, "token")
    ca_path: str | None = os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InCluster:
        """The API server a pod sees (`KUBERNETES_SERVICE_HOST`/`_PORT`); `ApiError` outside Kubernetes."""
        env = os.environ if env is None else env
        host = env.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise ApiError("not running in Kubernetes (KUBERNETES_SERVICE_HOST unset)")
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}")

    def request(self, method: str, path: str, body: dict | None = None, *,
                content_type: str = "application/json", timeout: float = 5.0) -> dict:
        """`method` on `path` (`/api/v1/...`) with `body` as JSON; the answer's JSON. `ApiError` on any failure,
        its message one line naming the URL."""
        url = f"{self.url.rstrip('/')}{path}"
        try:
            with open(self.token_path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ApiError(f"no service-account token ({exc.strerror}: {self.token_path})") from None
        request = urllib.request.Request(
            url, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json", "Content-Type": content_type})
        context = None
        if url.startswith("https:"):
            cafile = self.ca_path if self.ca_path and os.path.exists(self.ca_path) else None
            context = ssl.create_default_context(cafile=cafile)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            raise ApiError(f"HTTP {exc.code} from {method} {url}", exc.code, exc.code >= 500 or exc.code == 429) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ApiError(f"cannot reach {url}: {exc}", retry=True) from None
        except ValueError as exc:  # an answer that is not JSON
            raise ApiError(f"{method} {url}: {exc}") from None


def pod_namespace(env: Mapping[str, str] | None = None) -> str | None:
    """This pod's namespace: `POD_NAMESPACE` (the chart's downward API), else the service account's file."""
    env = os.environ if env is None else env
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        with open(os.path.join(SERVICE_ACCOUNT_DIR, "namespace"), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
