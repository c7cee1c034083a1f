#!/usr/bin/env python3
"""Offline checks of Pie's deployment files (run by .ci/run).

1. deploy/Dockerfile: parsed (no image can be built on the project's machines):
   a builder stage and a runtime stage, both binaries copied, a non-root USER,
   EXPOSE of the configured ports, a HEALTHCHECK on /health, tini as PID 1.
2. deploy/k8s: the base and every overlay are rendered with a small kustomize
   subset (resources, strategic-merge `patches` by kind and name, `images`;
   any other kustomization key is refused, so nothing is silently ignored) and
   every core resource is validated, strict (unknown fields refused), against
   the Kubernetes JSON schemas bundled in the `kubernetes-validate` package.
   The KEDA ScaledObject (a CRD) is NOT schema-validated; it gets structural
   checks (target exists, the query names the controller's gauge).
3. Consistency with the code: probe paths are routes of the server in that
   container (crates/pie-worker/src/api/mod.rs, crates/pie-controller/src/api/mod.rs);
   container, probe and Service ports agree with the port in the ConfigMap's
   config.toml; terminationGracePeriodSeconds > preStop sleep + the declared
   shutdown time; worker self-registration (pod IP bind, register Service,
   worker-role key in the Secret and in the controller's key file).
4. With PIE_BIN (a built `pie`), `pie config check` on the workers' config.toml.

Exits 1 with one line per failure.
"""

import copy
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import yaml

try:
    import kubernetes_validate
except ModuleNotFoundError:
    sys.exit("deploy/check.py: the `kubernetes-validate` package is required "
             "(python3 -m pip install kubernetes-validate)")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = os.environ.get("PIE_K8S_VERSION", "1.30.0")
SOURCES = {
    "worker": ROOT / "crates/pie-worker/src/api/mod.rs",
    "controller": ROOT / "crates/pie-controller/src/api/mod.rs",
}
SIGNAL_SOURCES = {
    "worker": [ROOT / "crates/pie-worker/src/serve.rs", ROOT / "crates/pie-worker/src/main.rs"],
    "controller": [ROOT / "crates/pie-controller/src/main.rs"],
}
DEFAULT_PORT = {"worker": 8080, "controller": 9090}
CORE_GROUPS = ("v1", "apps/v1", "networking.k8s.io/v1", "batch/v1", "policy/v1", "autoscaling/v2")

failures = []


def fail(where, msg):
    failures.append(f"{where}: {msg}")


# --- kustomize subset --------------------------------------------------------

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}


def load_yaml(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def merge(base, patch):
    """Strategic merge, the subset used here: maps recursively, lists of maps
    with `name` merged by name, other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list)
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for p in patch:
            for i, b in enumerate(out):
                if b["name"] == p["name"]:
                    out[i] = merge(b, p)
                    break
            else:
                out.append(copy.deepcopy(p))
        return out
    return copy.deepcopy(patch)


def pod_spec(doc):
    return doc.get("spec", {}).get("template", {}).get("spec")


def all_containers(spec):
    return (spec.get("initContainers") or []) + (spec.get("containers") or [])


def render(directory):
    kpath = directory / "kustomization.yaml"
    where = str(kpath.relative_to(ROOT))
    [k] = load_yaml(kpath)
    for key in set(k) - SUPPORTED_KEYS:
        fail(where, f"`{key}` is not supported by deploy/check.py's renderer; "
                    "extend the renderer or keep overlays to resources/patches/images")
    docs = []
    for r in k.get("resources", []):
        p = (directory / r).resolve()
        docs += render(p) if p.is_dir() else load_yaml(p)
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            fail(where, f"patch {patch}: only `path:` (strategic merge) is supported")
            continue
        for pd in load_yaml(directory / patch["path"]):
            key = (pd["kind"], pd["metadata"]["name"])
            hits = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == key]
            if len(hits) != 1:
                fail(where, f"patch {patch['path']} targets {key}, found {len(hits)} matches")
                continue
            before = docs[hits[0]]
            docs[hits[0]] = merge(before, pd)
            # a patched container name must exist (else kustomize adds a
            # container with no image, and we would validate a typo away)
            spec = pod_spec(pd)
            if spec:
                have = {c["name"] for c in all_containers(pod_spec(before))}
                for c in all_containers(spec):
                    if c["name"] not in have:
                        fail(where, f"patch {patch['path']}: no container `{c['name']}` in {key}")
    for img in k.get("images", []):
        used = False
        for d in docs:
            spec = pod_spec(d)
            for c in all_containers(spec) if spec else []:
                name, _, tag = c.get("image", "").partition(":")
                if name == img["name"]:
                    used = True
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
        if not used:
            fail(where, f"images: no container uses `{img['name']}`")
    return docs


# --- checks ------------------------------------------------------------------

def routes(kind):
    return set(re.findall(r'\.route\(\s*"([^"]+)"', SOURCES[kind].read_text()))


def server_kind(container):
    cmd = (container.get("command") or []) + (container.get("args") or [])
    if cmd[:2] == ["pie", "serve"]:
        return "worker"
    if cmd[:1] == ["pie-controller"]:
        return "controller"
    return None


def arg(container, flag):
    cmd = (container.get("command") or []) + (container.get("args") or [])
    return cmd[cmd.index(flag) + 1] if flag in cmd and cmd.index(flag) + 1 < len(cmd) else None


def mounted_file(docs, spec, container, path, where):
    """The text of `path` inside `container`, from a ConfigMap or Secret volume."""
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(mp):
            continue
        rel = path[len(mp):]
        vol = next((v for v in spec.get("volumes", []) if v["name"] == m["name"]), None)
        if vol is None:
            fail(where, f"volumeMount `{m['name']}` has no volume")
            return None
        if "configMap" in vol:
            kind, name, field = "ConfigMap", vol["configMap"]["name"], "data"
            items = vol["configMap"].get("items")
        elif "secret" in vol:
            kind, name, field = "Secret", vol["secret"]["secretName"], "stringData"
            items = vol["secret"].get("items")
        else:
            return None
        key = next((i["key"] for i in items if i["path"] == rel), None) if items else rel
        src = next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)
        if src is None or key not in (src.get(field) or {}):
            fail(where, f"{path}: {kind} `{name}` has no key `{key}`")
            return None
        return src[field][key]
    fail(where, f"{path} is not mounted from a ConfigMap or Secret")
    return None


def port_number(container, port, where, what):
    if isinstance(port, int):
        return port
    p = next((p for p in container.get("ports", []) if p.get("name") == port), None)
    if p is None:
        fail(where, f"{what}: no container port named `{port}`")
        return None
    return p["containerPort"]


def preStop_seconds(container):
    cmd = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if cmd[:1] == ["sleep"] and len(cmd) == 2:
        return int(cmd[1])
    return 0 if not cmd else None


def handles_sigterm(kind):
    return any("SignalKind::terminate" in p.read_text() or "ctrl_c" in p.read_text()
               for p in SIGNAL_SOURCES[kind])


def check_workload(docs, d, name, where, ports_seen):
    spec = pod_spec(d)
    for c in spec.get("containers", []):
        kind = server_kind(c)
        if kind is None:
            continue
        cw = f"{where} {d['kind']}/{name} container {c['name']}"
        cfg_path = arg(c, "--config")
        cfg = {}
        if cfg_path is None:
            fail(cw, "no --config (config.toml from the ConfigMap)")
        else:
            text = mounted_file(docs, spec, c, cfg_path, cw)
            if text is not None:
                try:
                    cfg = tomllib.loads(text)
                except tomllib.TOMLDecodeError as e:
                    fail(cw, f"{cfg_path} is not valid TOML: {e}")
                if kind == "worker" and os.environ.get("PIE_BIN"):
                    config_check(text, cw)
        port = int(arg(c, "--port") or cfg.get("server", {}).get("port", DEFAULT_PORT[kind]))
        ports_seen.setdefault(kind, set()).add(port)
        cports = [p["containerPort"] for p in c.get("ports", [])]
        if port not in cports:
            fail(cw, f"the server listens on {port} (config.toml), containerPorts are {cports}")
        # probes
        known = routes(kind)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            pr = c.get(probe)
            if pr is None:
                if probe != "startupProbe":
                    fail(cw, f"no {probe}")
                continue
            if "httpGet" in pr:
                path = pr["httpGet"]["path"]
                if path not in known:
                    fail(cw, f"{probe} path {path} is not a route of pie-{kind} "
                             f"({SOURCES[kind].relative_to(ROOT)})")
                got = port_number(c, pr["httpGet"]["port"], cw, probe)
            elif "tcpSocket" in pr:
                got = port_number(c, pr["tcpSocket"]["port"], cw, probe)
            else:
                fail(cw, f"{probe}: expected httpGet or tcpSocket")
                continue
            if got is not None and got != port:
                fail(cw, f"{probe} probes port {got}, the server listens on {port}")
        if kind == "worker" and c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/health":
            fail(cw, "readinessProbe must be GET /health (503 while loading or unhealthy)")
        if kind == "controller" and "/health" in str(c.get("livenessProbe", {})):
            fail(cw, "the controller's /health is 503 with no healthy worker: not a liveness route")
        # termination
        grace = spec.get("terminationGracePeriodSeconds", 30)
        pre = preStop_seconds(c)
        ann = d["spec"]["template"].get("metadata", {}).get("annotations", {})
        if pre is None:
            fail(cw, "preStop must be `sleep N` (or absent) for the grace-period check")
            pre = 0
        if "pie.dev/shutdown-seconds" not in ann:
            fail(cw, "pod template annotation pie.dev/shutdown-seconds (the server's shutdown time) is missing")
        shutdown = int(ann.get("pie.dev/shutdown-seconds", 0))
        if not grace > pre + shutdown:
            fail(cw, f"terminationGracePeriodSeconds {grace} must exceed preStop {pre} s "
                     f"+ shutdown {shutdown} s")
        if kind == "worker":
            check_drain(c, cfg, shutdown, cw)
        elif handles_sigterm(kind):
            fail(cw, f"pie-{kind} now handles SIGTERM (drain?): set pie.dev/shutdown-seconds to its "
                     "shutdown timeout, revisit the liveness probe (a draining pod must stay live) "
                     "and update this check")
        if kind == "worker":
            check_registration(docs, c, cw)
        if kind == "controller" and d["spec"].get("replicas", 1) != 1:
            fail(cw, "the controller must run as exactly 1 replica (its state is in memory)")
        if kind == "controller":
            check_worker_key_listed(docs, spec, c, cfg, cw)


# `[server] drain_timeout_ms` when config.toml does not set it (pie-worker's config.rs).
DEFAULT_DRAIN_TIMEOUT_MS = 120_000


def check_drain(c, cfg, shutdown, cw):
    """pie serve drains on SIGTERM for up to drain_timeout_ms: the pod's shutdown
    budget must cover it, and liveness must stay 200 while draining (/livez;
    /health is 503 `draining`, so a liveness probe on it kills the pod mid-drain)."""
    if not handles_sigterm("worker"):
        fail(cw, "pie-worker no longer handles SIGTERM: the drain this manifest is sized for is gone")
    drain_ms = cfg.get("server", {}).get("drain_timeout_ms", DEFAULT_DRAIN_TIMEOUT_MS)
    if shutdown * 1000 < drain_ms:
        fail(cw, f"pie.dev/shutdown-seconds {shutdown} is shorter than server.drain_timeout_ms "
                 f"{drain_ms} ms: Kubernetes would kill the pod mid-drain")
    live = c.get("livenessProbe", {}).get("httpGet", {}).get("path")
    if live == "/health":
        fail(cw, "livenessProbe on /health: it is 503 while draining, so a draining worker "
                 "would be restarted; use /livez")


def check_registration(docs, c, cw):
    env = {e["name"]: e for e in c.get("env", [])}
    if arg(c, "--host") != "$(POD_IP)" or \
            env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
        fail(cw, "the worker must bind --host $(POD_IP) (POD_IP from status.podIP): "
                 "it registers the address it binds")
    url = arg(c, "--controller")
    if url is None or arg(c, "--name") is None:
        fail(cw, "self-registration needs --controller URL and --name")
        return
    m = re.fullmatch(r"http://([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)/?", url)
    svc = m and next((d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == m.group(1)), None)
    if not svc:
        fail(cw, f"--controller {url} does not name a Service of these manifests")
    else:
        if not svc["spec"].get("publishNotReadyAddresses"):
            fail(cw, f"Service {m.group(1)} must publish not-ready addresses: the controller is "
                     "not ready until a worker has registered")
        if int(m.group(2)) not in [p["port"] for p in svc["spec"]["ports"]]:
            fail(cw, f"--controller port {m.group(2)} is not a port of Service {m.group(1)}")
    ref = env.get("PIE_WORKER_KEY", {}).get("valueFrom", {}).get("secretKeyRef")
    if not ref:
        fail(cw, "PIE_WORKER_KEY must come from a Secret (secretKeyRef)")


def check_worker_key_listed(docs, spec, c, cfg, cw):
    """The workers' PIE_WORKER_KEY is in the controller's keys with role worker."""
    worker_keys = set()
    for d in docs:
        s = pod_spec(d) if d["kind"] in ("StatefulSet", "Deployment") else None
        for wc in (s or {}).get("containers", []):
            if server_kind(wc) != "worker":
                continue
            for e in wc.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if e["name"] == "PIE_WORKER_KEY" and ref:
                    sec = next((x for x in docs if x["kind"] == "Secret"
                                and x["metadata"]["name"] == ref["name"]), None)
                    val = (sec or {}).get("stringData", {}).get(ref["key"])
                    if val is None:
                        fail(cw, f"Secret {ref['name']} has no stringData key {ref['key']}")
                    else:
                        worker_keys.add(val)
    listed = {}
    path = cfg.get("server", {}).get("api_keys_file")
    if path:
        text = mounted_file(docs, spec, c, path, cw) or ""
        for line in text.splitlines():
            f = line.split()
            if f and not f[0].startswith("#"):
                listed[f[1]] = f[2] if len(f) > 2 and "=" not in f[2] else "client"
    for k in cfg.get("server", {}).get("api_keys", []):
        listed[k["key"]] = k.get("role", "client")
    for wk in worker_keys:
        if listed.get(wk) != "worker":
            fail(cw, "the workers' PIE_WORKER_KEY is not among the controller's keys with role "
                     "`worker`: registration would be refused")


def config_check(text, where):
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run([os.environ["PIE_BIN"], "config", "check", f.name],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(where, "`pie config check` refuses config.toml: " + ((r.stderr or r.stdout).strip().splitlines() or ["?"])[0])
    finally:
        os.unlink(f.name)


def check_services(docs, where):
    pods = [d for d in docs if pod_spec(d) is not None]
    for s in (d for d in docs if d["kind"] == "Service"):
        sel = s["spec"].get("selector", {})
        targets = [p for p in pods
                   if sel and all(p["spec"]["template"]["metadata"]["labels"].get(k) == v
                                  for k, v in sel.items())]
        sw = f"{where} Service/{s['metadata']['name']}"
        if not targets:
            fail(sw, f"selector {sel} matches no workload")
        for p in s["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            for t in targets:
                ports = [cp for c in pod_spec(t)["containers"] for cp in c.get("ports", [])]
                if not any(cp.get("name") == tp or cp["containerPort"] == tp for cp in ports):
                    fail(sw, f"targetPort {tp} is not a container port of {t['metadata']['name']}")
    if any(d["kind"] == "StatefulSet" for d in docs):
        for st in (d for d in docs if d["kind"] == "StatefulSet"):
            if not any(d["kind"] == "Service" and d["metadata"]["name"] == st["spec"]["serviceName"]
                       and d["spec"].get("clusterIP") == "None" for d in docs):
                fail(where, f"StatefulSet {st['metadata']['name']}: serviceName must be a headless Service")


def check_keda(docs, d, where):
    sw = f"{where} ScaledObject/{d['metadata']['name']}"
    ref = d["spec"]["scaleTargetRef"]
    if not any(x["kind"] == ref.get("kind", "Deployment") and x["metadata"]["name"] == ref["name"]
               for x in docs):
        fail(sw, f"scaleTargetRef {ref.get('kind')}/{ref['name']} is not in these manifests")
    metrics = (ROOT / "crates/pie-controller/src/metrics.rs").read_text()
    gauge_defined = ('sub_registry_with_prefix("pie_cluster")' in metrics
                     and '"scale_recommended"' in metrics)
    spec = d["spec"]
    for k in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        if k in spec and not isinstance(spec[k], int):
            fail(sw, f"{k} must be an integer")
    # The autoscaler's bounds are the advisor's: scale-by-prop clamps its
    # recommendation to [min_workers, max_workers] in the controller's config.
    sbp = {}
    for x in docs:
        if x["kind"] == "ConfigMap" and "config.toml" in x.get("data", {}):
            cfg = tomllib.loads(x["data"]["config.toml"])
            sbp = cfg.get("cluster", {}).get("scale-by-prop", sbp)
    for key, ours, default in (("minReplicaCount", "min_workers", 1), ("maxReplicaCount", "max_workers", 16)):
        if spec.get(key) != sbp.get(ours, default):
            fail(sw, f"{key} {spec.get(key)} differs from [cluster.scale-by-prop] {ours} {sbp.get(ours, default)}")
    for t in spec["triggers"]:
        if not t.get("type") or not isinstance(t.get("metadata"), dict):
            fail(sw, "a trigger needs `type` and `metadata` (KEDA CRD)")
            continue
        for k, v in t["metadata"].items():
            if not isinstance(v, str):
                fail(sw, f"trigger metadata {k} must be a string (KEDA CRD: map of strings)")
        q = t.get("metadata", {}).get("query", "")
        if "pie_cluster_scale_recommended" not in q or not gauge_defined:
            fail(sw, "the trigger must query pie_cluster_scale_recommended (crates/pie-controller/src/metrics.rs)")


def check_manifests(name, docs, ports_seen):
    where = f"k8s {name}"
    seen = set()
    for d in docs:
        key = (d["kind"], d["metadata"]["name"])
        if key in seen:
            fail(where, f"duplicate {key}")
        seen.add(key)
        if d["apiVersion"] in CORE_GROUPS:
            try:
                kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                fail(f"{where} {d['kind']}/{d['metadata']['name']}",
                     f"schema (Kubernetes {K8S_VERSION}): {e.message} at {'.'.join(map(str, e.path))}")
            except (kubernetes_validate.SchemaNotFoundError,
                    kubernetes_validate.InvalidSchemaError) as e:
                fail(f"{where} {d['kind']}/{d['metadata']['name']}", f"no schema: {e}")
        elif d["kind"] == "ScaledObject" and d["apiVersion"] == "keda.sh/v1alpha1":
            check_keda(docs, d, where)
        else:
            fail(where, f"{d['apiVersion']} {d['kind']}: neither core nor KEDA; not validated")
        if d["kind"] in ("Deployment", "StatefulSet"):
            check_workload(docs, d, d["metadata"]["name"], where, ports_seen)
    check_services(docs, where)


def dockerfile_instructions(text):
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if buf and s.startswith("#"):
            continue
        buf += " " + s[:-1] if s.endswith("\\") else " " + s
        if not s.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def check_dockerfile(ports_seen):
    where = "deploy/Dockerfile"
    ins = dockerfile_instructions((ROOT / where).read_text())
    known = {"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE", "VOLUME",
             "HEALTHCHECK", "ENTRYPOINT", "CMD", "LABEL", "STOPSIGNAL", "SHELL", "ONBUILD"}
    for w, _ in ins:
        if w not in known:
            fail(where, f"unknown instruction {w}")
    stages = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    if len(stages) < 2:
        fail(where, "expected a multi-stage build (a builder and a runtime stage)")
        return
    names = [ins[i][1].split()[-1] for i in stages if " AS " in ins[i][1].upper()]
    final = ins[stages[-1]:]
    build = " ".join(r for w, r in ins[:stages[-1]] if w == "RUN")
    for b in ("pie", "pie-controller"):
        if f"--bin {b}" not in build:
            fail(where, f"the builder does not build `{b}`")
    copies = [r for w, r in final if w == "COPY" and r.startswith("--from=")]
    if not any(r.split()[0].split("=")[1] in names for r in copies):
        fail(where, "the runtime stage copies nothing from the builder stage")
    if not any("pie-controller" in r for r in copies) or not any("/pie " in r + " " for r in copies):
        fail(where, "the runtime stage must copy both `pie` and `pie-controller`")
    users = [r for w, r in final if w == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        fail(where, "the runtime stage must end as a non-root USER")
    exposed = {int(p.split("/")[0]) for w, r in final if w == "EXPOSE" for p in r.split()}
    for kind, ports in ports_seen.items():
        for p in ports:
            if p not in exposed:
                fail(where, f"EXPOSE lacks {p} (pie-{kind}'s port in the manifests)")
    hc = [r for w, r in final if w == "HEALTHCHECK"]
    if not hc or "/health" not in hc[-1] or "CMD" not in hc[-1]:
        fail(where, "HEALTHCHECK must probe /health")
    elif "/health" not in routes("worker"):
        fail(where, "HEALTHCHECK probes /health, which pie serve does not route")
    ep = [r for w, r in final if w == "ENTRYPOINT"]
    if not ep or "tini" not in ep[-1]:
        fail(where, "ENTRYPOINT must be an init (tini): the kernel ignores SIGTERM to PID 1 "
                    "without a handler, and pie installs none")
    if not any(w == "VOLUME" and "/models" in r for w, r in final):
        fail(where, "VOLUME /models (the model volume) is missing")
    cmd = [r for w, r in final if w == "CMD"]
    if not cmd or "serve" not in cmd[-1] or "0.0.0.0" not in cmd[-1]:
        fail(where, "CMD must run `pie serve` bound to 0.0.0.0 (the config default is 127.0.0.1)")


def main():
    ports_seen = {}
    targets = [("base", K8S / "base")] + sorted(
        (f"overlays/{p.name}", p) for p in (K8S / "overlays").iterdir() if p.is_dir())
    counts = []
    for name, directory in targets:
        docs = render(directory)
        check_manifests(name, docs, ports_seen)
        counts.append(f"{name}: {len(docs)} resources")
    check_dockerfile(ports_seen)
    if failures:
        for f in failures:
            print(f"FAIL {f}", file=sys.stderr)
        print(f"deploy/check.py: {len(failures)} failure(s)", file=sys.stderr)
        sys.exit(1)
    extra = " + `pie config check`" if os.environ.get("PIE_BIN") else ""
    print(f"deploy/check.py: ok (Kubernetes {K8S_VERSION} schemas, strict{extra}; "
          f"KEDA ScaledObject structural only) -- " + "; ".join(counts))


if __name__ == "__main__":
    main()
