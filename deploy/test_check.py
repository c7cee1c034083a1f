#!/usr/bin/env python3
"""Self-test of deploy/check.py: the files as committed pass, and each broken
copy (in a temporary tree) fails with the message that names the breakage.
Run by .ci/run after deploy/check.py."""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["crates/pie-worker/src/api/mod.rs", "crates/pie-worker/src/serve.rs",
           "crates/pie-worker/src/main.rs", "crates/pie-controller/src/api/mod.rs",
           "crates/pie-controller/src/main.rs", "crates/pie-controller/src/metrics.rs"]

W = "deploy/k8s/base/worker.yaml"
C = "deploy/k8s/base/controller.yaml"
CASES = [
    # (name, file, old, new, expected substring of the failure)
    ("wrong readiness path", W, "path: /health\n              port: http\n            periodSeconds: 5\n            failureThreshold: 2",
     "path: /healthz\n              port: http\n            periodSeconds: 5\n            failureThreshold: 2",
     "readinessProbe path /healthz is not a route of pie-worker"),
    ("unknown field (strict schema)", W, "podManagementPolicy: Parallel", "podManagementPolicy: Parallel\n  replica: 3",
     "schema (Kubernetes"),
    ("wrong field type", W, "replicas: 2", "replicas: two", "schema (Kubernetes"),
    ("container port vs config", W, "containerPort: 8080", "containerPort: 8081",
     "the server listens on 8080"),
    ("grace period too short", W, "terminationGracePeriodSeconds: 135", "terminationGracePeriodSeconds: 60",
     "terminationGracePeriodSeconds 60 must exceed preStop 5 s + shutdown 120 s"),
    ("controller liveness on /health", C, "tcpSocket:\n              port: http", "httpGet:\n              path: /health\n              port: http",
     "not a liveness route"),
    ("two controllers", C, "replicas: 1", "replicas: 2", "exactly 1 replica"),
    ("worker binds 0.0.0.0", W, "- $(POD_IP)", "- 0.0.0.0", "--host $(POD_IP)"),
    ("register via the client Service", W, "http://pie-controller-register:9090", "http://pie:9090",
     "must publish not-ready addresses"),
    ("worker key not listed", "deploy/k8s/base/secret.yaml", "pie-workers sk-pie-worker-CHANGE-ME worker",
     "pie-workers sk-pie-worker-CHANGE-ME client", "registration would be refused"),
    ("service targetPort", C, "targetPort: http\n---\n# Workers", "targetPort: web\n---\n# Workers",
     "targetPort web is not a container port"),
    ("overlay patches a missing container", "deploy/k8s/overlays/prod/worker-patch.yaml", "- name: worker", "- name: wroker",
     "no container `wroker`"),
    ("unsupported kustomize key", "deploy/k8s/overlays/dev/kustomization.yaml", "resources:", "namePrefix: x-\nresources:",
     "`namePrefix` is not supported"),
    ("KEDA gauge name", "deploy/k8s/overlays/keda/scaledobject.yaml", "pie_cluster_scale_recommended", "pie_scale",
     "must query pie_cluster_scale_recommended"),
    ("KEDA bounds vs scale-by-prop", "deploy/k8s/overlays/keda/scaledobject.yaml", "maxReplicaCount: 16", "maxReplicaCount: 10",
     "maxReplicaCount 10 differs from [cluster.scale-by-prop] max_workers 16"),
    ("KEDA metadata type", "deploy/k8s/overlays/keda/scaledobject.yaml", 'threshold: "1"', "threshold: 1",
     "trigger metadata threshold must be a string"),
    ("Dockerfile as root", "deploy/Dockerfile", "USER 10001:10001", "USER root", "non-root USER"),
    ("Dockerfile healthcheck", "deploy/Dockerfile", '/health" || exit 1', '/status" || exit 1', "HEALTHCHECK must probe /health"),
    ("controller learns SIGTERM", "crates/pie-controller/src/main.rs", "SignalKind::hangup()", "SignalKind::terminate()",
     "now handles SIGTERM"),
    ("worker forgets SIGTERM", "crates/pie-worker/src/serve.rs", "SignalKind::terminate()", "SignalKind::hangup()",
     "no longer handles SIGTERM"),
    ("worker liveness on /health", W, "path: /livez", "path: /health", "would be restarted; use /livez"),
    ("drain longer than the shutdown budget", W, 'pie.dev/shutdown-seconds: "120"', 'pie.dev/shutdown-seconds: "60"',
     "shorter than server.drain_timeout_ms 120000 ms"),
]


def run(tree):
    return subprocess.run([sys.executable, str(tree / "deploy/check.py")], capture_output=True, text=True)


def main():
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "clean"
        shutil.copytree(ROOT / "deploy", base / "deploy")
        for s in SOURCES:
            (base / s).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / s, base / s)
        r = run(base)
        if r.returncode != 0:
            bad.append(f"the committed files fail:\n{r.stderr}")
        for i, (name, path, old, new, expect) in enumerate(CASES):
            tree = Path(tmp) / f"case{i}"
            shutil.copytree(base, tree)
            text = (tree / path).read_text()
            if text.count(old) < 1:
                bad.append(f"{name}: `{old[:40]}` not found in {path} (update the test)")
                continue
            (tree / path).write_text(text.replace(old, new, 1))
            r = run(tree)
            if r.returncode == 0 or expect not in r.stderr:
                bad.append(f"{name}: expected failure containing {expect!r}, got rc={r.returncode}:\n{r.stderr}")
            else:
                line = next(l for l in r.stderr.splitlines() if expect in l)
                print(f"ok  {name}: {line}")
    if bad:
        print("\n".join(f"FAIL {b}" for b in bad), file=sys.stderr)
        sys.exit(1)
    print(f"deploy/test_check.py: {len(CASES)} broken copies each fail as expected")


if __name__ == "__main__":
    main()
