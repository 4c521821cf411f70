"""Gather the precheck's evidence into `DIR/evidence/`, and load it back from there.

Why copy everything first and judge only the copies: the record must be re-checkable offline (a run
from a GPU cluster is judged again on a laptop), so the rules never see a live server or a file
outside `evidence/`; `load_evidence` is the only way in, and `recheck` re-runs it on a saved DIR.

Layout under DIR. Every path the record names (a rule's `evidence`, index.json, fetch.json, compat.json's
`evidence` hashes) is relative to DIR/evidence/, e.g. "startup.log", "hosts/00-gb300-n01.json":
  evidence/index.json              what was gathered: source path or URL, sha256, notes
  evidence/server/fetch.json       base URL (no credentials), status and error of each endpoint
  evidence/server/version.json     GET /version body as received (every secret sent redacted, as in all below)
  evidence/server/models.json      GET /v1/models body
  evidence/server/metrics.txt      GET /metrics body (vllm:cache_config_info, k3load_sim_info), from the
                                   first --k3-metrics-url when given; read only when it answered 200
  evidence/server/probe_chat.json  1-token chat answer, only when /metrics cannot tell sim from vLLM
  evidence/container/collect-env.txt   the saved `vllm collect-env` output (--container-info, a bare path)
  evidence/container/NODE/collect-env.txt   node NODE's (--container-info NODE=PATH, one per node)
  evidence/container/image.json    {"image": TAG} from --image
  evidence/hosts/NN-NAME.json      host inventories as given (--host-inventory), byte for byte
  evidence/hosts/local-nvml.json   this host's NVML inventory (k3load.sampler.nvml.inventory)
  evidence/startup.log             the vLLM startup log (--startup-log, a bare path: one unnamed node)
  evidence/startup/NODE.log        node NODE's startup log (--startup-log NODE=PATH, one per node;
                                   k3load.precheck.node_evidence)
  evidence/custom-build.yaml|json  the custom build record (--custom-build)

Secrets: the API key and gateway header values (k3load.client.access.Secrets) go in the headers of the
requests to the target and are replaced by "[redacted]" in everything saved here, in every form a server
can echo them (k3load.client.secret_forms), the operator's copied files included (a vLLM startup log
prints its own --api-key): they are redacted while they are copied, into a 0600 temporary file renamed
into place, so no secret is ever on disk in clear, not even for the length of a copy or after an
interrupted one. A copy that had to be changed says so in index.json's notes, and its sha256 is the
redacted copy's. Every file here is 0600 and every folder 0700 (k3load.private_files).

Host inventory JSON (one file per node): exactly what `k3load.sampler.nvml.inventory()` returns on
that node, plus `node` and `container_image` (the tag that node runs). Read here:
  {"node": "gb300-n01", "container_image": "vllm/vllm-openai:kimi-k3",
   "source": "nvml", "host": "gb300-n01", "driver_version": "580.95.05",
   "cuda_driver_max_version": "13.0",     # the driver's newest CUDA: recorded, never counted as the build
   "gpu_count": 4, "gpus": [{"index": 0, "name": "NVIDIA GB300", "uuid": "GPU-...", "memory_total_mib": 284208.0,
                             "pci_bus_id": "00000000:18:00.0", "nvlink_active_links": 18}, ...],
   "topology": {"matrix": [["X", "NVLINK", ...], ...], "legend": {...}} | null}
The format, checked field by field (a file that is not it is an EvidenceFormatError, never a rule
result), is in k3load/precheck/formats.py; an example is docs/examples/precheck/host-inventory.json.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from k3load.client.access import Secrets, Tls, gevent_patched, tls_hint
from k3load.precheck.evidence_store import EVIDENCE, Evidence, Gatherer, redact_body, sha256_file
from k3load.precheck.formats import (
    HOST_ALIASES,
    check_host_inventory,
    inventory_node,
    read_custom_build,
    read_host_inventory,
)
from k3load.precheck.node_evidence import gather_containers, gather_startups, load_node_files
from k3load.precheck.node_files import NodeFiles, as_node_files
from k3load.private_files import is_temp
from k3load.sampler.fetch import same_origin
from k3load.sampler.prom import LEGACY_FAMILIES, REQUIRED_SERIES
from k3load.sampler.vllm_metrics import VLLM_PREFIX, VllmMetric

ENDPOINTS = {"version": ("/version", "version.json"), "models": ("/v1/models", "models.json"),
             "metrics": ("/metrics", "metrics.txt")}
SIM_FINGERPRINT = "k3loadsim"
# The evidence folder's own names, importable from here as before (k3load.precheck.evidence_store holds them)
__all__ = ["EVIDENCE", "Evidence", "Gatherer", "redact_body", "sha256_file"]


def public_url(url: str) -> str:
    """The URL without user:password@, query or fragment: safe to write down."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    netloc += f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def gather_files(g: Gatherer, *, container_info: NodeFiles | Path | None,
                 host_inventories: list[Path] | tuple[Path, ...], startup_log: NodeFiles | Path | None,
                 image: str | None, custom_build: Path | None) -> None:
    """Copy the operator's files byte for byte; name the local file each came from in the index."""
    gather_containers(g, as_node_files(container_info, "--container-info"))
    if image is not None:
        g.write("container/image.json", {"image": image}, "--image")
    for i, path in enumerate(host_inventories):
        g.copy(path, f"hosts/{i:02d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', Path(path).stem)}.json")
    gather_startups(g, as_node_files(startup_log, "--startup-log"))
    if custom_build is not None:
        suffix = ".json" if Path(custom_build).suffix == ".json" else ".yaml"
        g.copy(custom_build, f"custom-build{suffix}")


def gather_local_nvml(g: Gatherer, image: str | None) -> None:
    """This host's NVML inventory, when the sampler module and a driver are there; else a note why not."""
    try:
        from k3load.sampler import nvml  # lazy: written separately, and NVML may be absent here
        inventory = nvml.inventory(nvml=None)
    except ImportError as exc:
        g.note(f"no local NVML: k3load.sampler.nvml not importable ({exc})")
        return
    except Exception as exc:  # an NVML failure is evidence of no usable driver, not a crash of the precheck
        g.note(f"no local NVML: inventory() raised {type(exc).__name__}: {exc}")
        return
    if inventory is None:
        g.note("no local NVML: no NVIDIA driver found on this host")
        return
    record = {"node": inventory.get("host") or socket.gethostname(), "container_image": image, **inventory}
    g.write("hosts/local-nvml.json", record, "k3load.sampler.nvml.inventory()")


def _get(client: httpx.Client, url: str, headers: dict[str, str]) -> tuple[int | None, bytes, str | None]:
    try:
        response = client.get(url, headers=headers)
        return response.status_code, response.content, None
    except httpx.HTTPError as exc:
        return None, b"", f"{type(exc).__name__}: {exc}{tls_hint(str(exc))}"


def gather_server(g: Gatherer, base_url: str, api_key: str | None, timeout_s: float = 15.0,
                  metrics_url: str | None = None, *, secrets: Secrets | None = None, tls: Tls | None = None) -> None:
    """GET /version, /v1/models, /metrics; bodies saved as received, secrets redacted. The key (and the
    gateway headers of `secrets`) only travel in headers, and to `metrics_url` (an engine's /metrics apart
    from the API, e.g. behind a gateway) only when it is on the API's own scheme, host and port. An error
    page's body is kept too (what a gateway said). `tls`: the run's trust for an https target."""
    secrets = secrets or Secrets(api_key)
    headers = secrets.request_headers()
    fetch: dict[str, Any] = {"base_url": public_url(base_url), "fetched_ts": time.time(), "endpoints": {}}
    root = base_url.rstrip("/")
    verify: Any = tls.context(gevent_patched()) if tls is not None else True
    with httpx.Client(timeout=timeout_s, verify=verify) as client:
        for name, (path, rel) in ENDPOINTS.items():
            url = metrics_url if name == "metrics" and metrics_url else root + path
            keyed = name != "metrics" or same_origin(url, root)
            status, body, error = _get(client, url, headers if keyed else {})
            error = secrets.redact(error) if error else error
            fetch["endpoints"][name] = {"path": path, "status": status, "error": error,
                                        "file": f"server/{rel}" if error is None else None}
            if url != root + path:
                fetch["endpoints"][name]["url"] = public_url(url)
            if error is None:
                g.write(f"server/{rel}", body, public_url(url))
        read = fetch["endpoints"]["metrics"]["status"] == 200
        metrics = _metrics_families(g.root / "server" / "metrics.txt") if read else {}
        if not ("k3load_sim_info" in metrics or any(m.startswith(VLLM_PREFIX) for m in metrics)):
            _probe_chat(g, client, root, fetch, headers)
    g.write("server/fetch.json", fetch, "k3load precheck")


def _probe_chat(g: Gatherer, client: httpx.Client, root: str, fetch: dict[str, Any],
                headers: dict[str, str]) -> None:
    """One 1-token request whose system_fingerprint tells the sim apart when /metrics cannot."""
    models = _json_file(g.root / "server" / "models.json") or {}
    model = next((m.get("id") for m in models.get("data", []) if isinstance(m, dict)), None)
    if model is None:
        return
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    try:
        response = client.post(root + "/v1/chat/completions", json=body, headers=headers)
    except httpx.HTTPError as exc:
        fetch["endpoints"]["probe_chat"] = {"path": "/v1/chat/completions", "status": None,
                                            "error": g.secrets.redact(str(exc))}
        return
    g.write("server/probe_chat.json", response.content, public_url(root + "/v1/chat/completions"))
    fetch["endpoints"]["probe_chat"] = {"path": "/v1/chat/completions", "status": response.status_code,
                                        "error": None, "file": "server/probe_chat.json"}


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _metrics_families(path: Path) -> dict[str, list[dict[str, str]]]:
    """Metric family name -> label sets of its samples; {} when absent or unparsable."""
    try:
        text = path.read_text(encoding="utf-8")
        return {fam.name: [dict(s.labels) for s in fam.samples] for fam in text_string_to_metric_families(text)}
    except (OSError, ValueError):
        return {}


def _engine_gauges_absent(families: dict[str, Any]) -> list[str]:
    """The scheduler and KV gauges a readable /metrics lacks (vLLM 0.32 with --disable-log-stats keeps
    only its tool-parser counter): without them there is nothing to monitor the engine by."""
    present = set(families) | {LEGACY_FAMILIES[name] for name in families if name in LEGACY_FAMILIES}
    return [name for name in REQUIRED_SERIES if name not in present]


def _load_server(root: Path, ev: Evidence) -> None:
    fetch = _json_file(root / "server" / "fetch.json")
    if not isinstance(fetch, dict):
        return
    metrics_status = (fetch.get("endpoints") or {}).get("metrics", {}).get("status")
    # A 404 page is kept as evidence of what answered, never read as metrics.
    families = _metrics_families(root / "server" / "metrics.txt") if metrics_status == 200 else {}
    version = _json_file(root / "server" / "version.json")
    models = _json_file(root / "server" / "models.json")
    probe = _json_file(root / "server" / "probe_chat.json")
    fingerprint = probe.get("system_fingerprint") if isinstance(probe, dict) else None
    sim_marker = None
    if "k3load_sim_info" in families:
        sim_marker = "k3load_sim_info on /metrics"
    elif isinstance(fingerprint, str) and fingerprint.endswith(SIM_FINGERPRINT):
        sim_marker = f"system_fingerprint {fingerprint!r}"
    configs = families.get(VllmMetric.CACHE_CONFIG_INFO)
    ev.server = {
        "base_url": fetch.get("base_url"), "endpoints": fetch.get("endpoints", {}),
        "version": version.get("version") if isinstance(version, dict) else None,
        "models": [m for m in models.get("data", []) if isinstance(m, dict)] if isinstance(models, dict) else [],
        "cache_config": configs[0] if configs else None,
        "vllm_series": sum(name.startswith(VLLM_PREFIX) for name in families),
        "sim_marker": sim_marker, "metrics_read": bool(families),
        "engine_gauges_absent": _engine_gauges_absent(families) if families else [],
    }
    for name in ("version", "models", "metrics", "probe_chat"):
        file = ev.server["endpoints"].get(name, {}).get("file")
        if file:
            ev.files[f"server_{name}"] = file
    ev.files["server_fetch"] = "server/fetch.json"


def _first(raw: dict[str, Any], key: str) -> Any:
    return next((raw[k] for k in HOST_ALIASES.get(key, (key,)) if raw.get(k) is not None), None)


def normalise_host(raw: Any, file: str) -> dict[str, Any]:
    """One node's inventory in the shape the rules read. A file that is not the format raises
    EvidenceFormatError (k3load.precheck.formats); `problems` says what a well-formed one leaves
    unrecorded (a driver version or GPU count given as null: NVML could not tell)."""
    check_host_inventory(raw, file)
    listed = raw.get("gpus")
    gpus = [g for g in listed if isinstance(g, dict)] if isinstance(listed, list) else []
    count = _first(raw, "gpu_count")
    host = {"node": inventory_node(raw, file), "file": file,
            "source": raw.get("source", "file"), "container_image": raw.get("container_image"),
            "driver_version": None if _first(raw, "driver_version") is None else str(_first(raw, "driver_version")),
            "cuda_driver_max_version": _first(raw, "cuda_driver_max_version"),
            "gpu_count": count if isinstance(count, int) else (len(gpus) or None),
            "gpu_names": [str(g.get("name")) for g in gpus if g.get("name")],
            "topology": raw.get("topology") is not None, "problems": []}
    if host["driver_version"] is None:
        host["problems"].append("no driver_version")
    if host["gpu_count"] is None:
        host["problems"].append("no gpu_count")
    return host


def _load_files(root: Path, ev: Evidence, platform: str) -> None:
    load_node_files(root, ev, platform)
    image = _json_file(root / "container" / "image.json")
    if isinstance(image, dict) and image.get("image"):
        ev.image = str(image["image"])
        ev.files["image"] = "container/image.json"
    for path in sorted((root / "hosts").glob("*.json")):
        rel = f"hosts/{path.name}"
        ev.hosts.append(normalise_host(read_host_inventory(path), rel))  # a malformed copy: named by its path
    for path in sorted(root.glob("custom-build.*")):
        ev.custom_build = {"record": read_custom_build(path), "error": None, "file": path.name}
        ev.files["custom_build"] = path.name


def load_evidence(out_dir: Path, platform: str) -> Evidence:
    """Read DIR/evidence back into an Evidence; nothing outside that folder is consulted."""
    root = Path(out_dir) / EVIDENCE
    ev = Evidence()
    index = _json_file(root / "index.json")
    if isinstance(index, dict):
        ev.notes = [str(n) for n in index.get("notes", [])]
    _load_server(root, ev)
    _load_files(root, ev, platform)
    return ev


def evidence_hashes(out_dir: Path) -> list[dict[str, str]]:
    """sha256 of every file under DIR/evidence (paths relative to it), sorted: compat.json fixes what it judged."""
    root = Path(out_dir) / EVIDENCE
    files = sorted(p for p in root.rglob("*") if p.is_file() and not is_temp(p))
    return [{"path": p.relative_to(root).as_posix(), "sha256": sha256_file(p)} for p in files]
