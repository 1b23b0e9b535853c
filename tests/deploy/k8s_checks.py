#!/usr/bin/env python3
"""Offline checks of deploy/k8s (issue 18): run as `k8s_checks.py CHECK`.

  render   kubectl kustomize renders the base and every overlay; each holds the
           objects it must (the four Tandem Deployments, their PDBs, ...).
  policy   the project's policy asserts on every rendered overlay (see POLICY below);
           `policy --self-test` first shows each assert fires on a broken copy.
  schema   every core object passes kubernetes-models' typed schema (node).
  crd      the HyperPod InferenceEndpointConfig validates against the CRD's
           openAPIV3Schema (python3-jsonschema), with no field the API server
           would prune.
  flags    every --flag a manifest passes to a Tandem binary is one that binary's
           --help lists (the binaries are built by Bazel: data deps); the
           all-in-one script's command lines (--dry-run) too.

Each check prints "SKIP: <why>" and exits 0 where its tool is absent (kubectl,
node + kubernetes-models, jsonschema). Run from the Bazel runfiles root (sh_test)
or the repository root.
"""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

OVERLAYS = [
    "cpu-dev",
    "eks-p6-b300",
    "hyperpod-p6-b300",
    "hyperpod-p6-b300/inference-endpoint",
    "amd-mi355x",
]
GPU_EFA_OVERLAYS = {"eks-p6-b300", "hyperpod-p6-b300"}
COMPONENTS = ["router", "gateway", "prefill", "decode"]
WORKERS = ["prefill", "decode"]
IEC = "inference.sagemaker.aws.amazon.com/v1/InferenceEndpointConfig"
# The longest request (--request_timeout_s, the gateway's and router's default).
LONGEST_REQUEST_S = 600
# Loading ~1.5 TB of weights takes tens of minutes; startup budgets are hours.
MIN_WORKER_STARTUP_S = 2 * 3600
# The Tandem binaries in the image and where Bazel puts them in runfiles.
BINARIES = {
    "router_main": "router/router_main",
    "prefill_main": "prefill/prefill_main",
    "decode_main": "decode/decode_main",
    "gateway_main": "gateway/gateway_main",
}
SCRIPTS = {
    "tandem-allinone": "tools/image/tandem-allinone.sh",
    "tandem-fetch-weights": "tools/image/fetch-weights.sh",
}
BIN_PREFIX = "/opt/tandem/bin/"


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(0)


def fail(errors):
    for e in errors:
        print(f"FAIL: {e}")
    print(f"{len(errors)} problem(s)")
    sys.exit(1)


# ------------------------------------------------------------------ rendering
def deploy_copy():
    """A dereferenced copy of deploy/ (runfiles are symlinks; kustomize wants files)."""
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    shutil.copytree("deploy", os.path.join(tmp, "deploy"), symlinks=False)
    return os.path.join(tmp, "deploy")


def render(root, path):
    r = subprocess.run(["kubectl", "kustomize", os.path.join(root, "k8s", path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path}: {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def render_all():
    if shutil.which("kubectl") is None:
        skip("kubectl is not installed (needed to render the overlays)")
    root = deploy_copy()
    out = {}
    for o in OVERLAYS:
        out[o] = render(root, "overlays/" + o)
    return out


def kind_id(obj):
    return f"{obj['apiVersion']}/{obj['kind']}"


def find(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and
            (name is None or o["metadata"]["name"] == name)]


def tandem_deployments(objs):
    """component -> Deployment, for the four Tandem processes."""
    out = {}
    for d in find(objs, "Deployment"):
        c = d["spec"]["template"]["metadata"].get("labels", {}).get(
            "app.kubernetes.io/component")
        if c in COMPONENTS:
            out[c] = d
    return out


def check_render():
    rendered = render_all()
    errors = []
    for o, objs in rendered.items():
        kinds = sorted({o2["kind"] for o2 in objs})
        print(f"{o}: {len(objs)} objects ({', '.join(kinds)})")
        if o.endswith("inference-endpoint"):
            if [kind_id(x) for x in objs] != [IEC]:
                errors.append(f"{o}: expected exactly one {IEC}")
            continue
        deps = tandem_deployments(objs)
        for c in COMPONENTS:
            if c not in deps:
                errors.append(f"{o}: no {c} Deployment")
        for name in ["tandem-router", "tandem-gateway"]:
            if not find(objs, "Service", name):
                errors.append(f"{o}: no Service {name}")
        for c in COMPONENTS:
            if not find(objs, "PodDisruptionBudget", f"tandem-{c}"):
                errors.append(f"{o}: no PodDisruptionBudget tandem-{c}")
        for k in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Namespace"]:
            if not find(objs, k):
                errors.append(f"{o}: no {k}")
        cms = [c["metadata"]["name"] for c in find(objs, "ConfigMap")]
        for prefix in ["tandem-prometheus-", "tandem-grafana-dashboard-"]:
            if not any(n.startswith(prefix) for n in cms):
                errors.append(f"{o}: no ConfigMap {prefix}*")
    if errors:
        fail(errors)
    print(f"rendered {len(rendered)} overlays")


# ------------------------------------------------------------------ policy
def containers(pod_spec, init=True):
    cs = list(pod_spec.get("containers", []))
    if init:
        cs += pod_spec.get("initContainers", [])
    return cs


def args_of(c):
    """--name=value flags of a container as {name: value} (last one wins, as Abseil)."""
    out = {}
    for a in c.get("args", []):
        m = re.match(r"^--([A-Za-z0-9_-]+)(?:=(.*))?$", a)
        if m:
            out[m.group(1).replace("-", "_")] = m.group(2)
    return out


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def probe_port(p):
    for k in ("grpc", "tcpSocket", "httpGet"):
        if k in p:
            return k, p[k].get("port")
    # An exec probe of health_check (mTLS: Kubernetes' gRPC probes present no
    # client certificate): the port of its --address=127.0.0.1:PORT.
    cmd = p.get("exec", {}).get("command", [])
    if cmd and cmd[0].endswith("/health_check"):
        for a in cmd[1:]:
            m = re.match(r"^--address=127\.0\.0\.1:(.+)$", a)
            if m:
                return "health_check", int(m.group(1)) if m.group(1).isdigit() else m.group(1)
        return "health_check", None
    return None, None


TLS_FLAGS = ("tls_ca", "tls_cert", "tls_key")


def prom_keep_rules():
    """(label, regex) pairs of prometheus-kubernetes.yml's keep rules on pod metadata."""
    with open("deploy/monitoring/prometheus-kubernetes.yml") as f:
        cfg = yaml.safe_load(f)
    rules = []
    for job in cfg["scrape_configs"]:
        for r in job.get("relabel_configs", []):
            if r.get("action") != "keep":
                continue
            (src,) = r["source_labels"]
            rules.append((src, r["regex"]))
    return rules


def prom_meta(pod_meta, name):
    """A pod's Kubernetes SD meta labels that the keep rules look at."""
    out = {"__meta_kubernetes_pod_phase": "Running"}
    for k, v in pod_meta.get("labels", {}).items():
        out["__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", k)] = v
    for k, v in pod_meta.get("annotations", {}).items():
        out["__meta_kubernetes_pod_annotation_" + re.sub(r"[^A-Za-z0-9_]", "_", k)] = v
    return out


def policy_errors(overlay, objs):
    """POLICY: every assert, as a list of messages (empty: all hold)."""
    errs = []
    E = lambda msg: errs.append(f"{overlay}: {msg}")  # noqa: E731
    if overlay.endswith("inference-endpoint"):
        for iec in objs:
            w = iec["spec"]["worker"]
            if not re.search(r":[^/]+$", w["image"]) or w["image"].endswith(":latest"):
                E(f"IEC worker image {w['image']} has no pinned tag")
            for p in ("startupProbe", "readinessProbe", "livenessProbe"):
                if p not in w.get("probes", {}):
                    E(f"IEC worker has no {p}")
            sp = w.get("probes", {}).get("startupProbe", {})
            if sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) < MIN_WORKER_STARTUP_S:
                E("IEC startup budget is under 2 h")
            if probe_port(w.get("probes", {}).get("livenessProbe", {}))[0] == "httpGet":
                E("IEC liveness is /health, which asks the router")
            if w["resources"].get("limits", {}).get("nvidia.com/gpu") != "8":
                E("IEC worker does not take the node's 8 GPUs")
            if w["modelInvocationPort"] != {"name": "http", "containerPort": 8000}:
                E("IEC modelInvocationPort is not http 8000")
            if "--tp=8" not in w.get("args", []):
                E("IEC worker is not TP8")
        return errs

    deps = tandem_deployments(objs)
    services = {s["metadata"]["name"]: s for s in find(objs, "Service")}
    keep = prom_keep_rules()
    for c, d in deps.items():
        name = d["metadata"]["name"]
        pod = d["spec"]["template"]
        spec = pod["spec"]
        labels = pod["metadata"].get("labels", {})
        ann = pod["metadata"].get("annotations", {})
        # Labels and annotations the Prometheus config selects.
        meta = prom_meta(pod["metadata"], name)
        for src, regex in keep:
            if not re.fullmatch(regex, meta.get(src, "")):
                E(f"{name}: Prometheus keep rule {src}=~{regex} drops it")
        if labels.get("app.kubernetes.io/component") != c:
            E(f"{name}: component label")
        main = spec["containers"][0]
        flags = args_of(main)
        ports = {p["containerPort"] for p in main.get("ports", [])}
        metrics_port = flags.get("metrics_port") if c != "gateway" else flags.get("port")
        if ann.get("prometheus.io/port") != metrics_port:
            E(f"{name}: prometheus.io/port {ann.get('prometheus.io/port')} is not the "
              f"/metrics port {metrics_port}")
        if metrics_port is None or int(metrics_port) not in ports:
            E(f"{name}: /metrics port {metrics_port} is not a containerPort")
        # Pinned images, resource requests, probes on numeric ports.
        for ct in containers(spec):
            img = ct.get("image", "")
            if "@sha256:" not in img and (not re.search(r":[^/]+$", img) or img.endswith(":latest")):
                E(f"{name}/{ct['name']}: image {img!r} has no pinned tag (or is latest)")
            req = ct.get("resources", {}).get("requests", {})
            for r in ("cpu", "memory"):
                if r not in req:
                    E(f"{name}/{ct['name']}: no {r} request")
            if "memory" not in ct.get("resources", {}).get("limits", {}):
                E(f"{name}/{ct['name']}: no memory limit")
        for p in ("startupProbe", "readinessProbe", "livenessProbe"):
            if p not in main:
                E(f"{name}: no {p}")
                continue
            kind, port = probe_port(main[p])
            if not isinstance(port, int):
                E(f"{name}: {p} port {port!r} is not numeric")
            elif port not in ports:
                E(f"{name}: {p} port {port} is not a containerPort")
            mtls = all(flags.get(f) for f in TLS_FLAGS)
            if c != "gateway" and not mtls and kind != "grpc":
                E(f"{name}: {p} is {kind}, not grpc")
            if c != "gateway" and mtls:
                # A gRPC probe fails against an mTLS server: health_check with the
                # process's own certificate.
                if kind != "health_check":
                    E(f"{name}: {p} is {kind} under mTLS (it cannot present a certificate)")
                else:
                    pf = dict(re.match(r"^--([a-z_]+)=(.*)$", a).groups()
                              for a in main[p]["exec"]["command"][1:] if a.startswith("--"))
                    for f in TLS_FLAGS:
                        if pf.get(f) != flags.get(f):
                            E(f"{name}: {p}'s --{f} is not the process's")
        # TLS: the three flags together, their files on a mounted Secret.
        given = [f for f in TLS_FLAGS if flags.get(f)]
        if given and len(given) != 3:
            E(f"{name}: only {given} of --tls_ca/--tls_cert/--tls_key")
        if given:
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            for f in given:
                mount = [m for m in main.get("volumeMounts", [])
                         if flags[f].startswith(m["mountPath"].rstrip("/") + "/")]
                if not mount or "secret" not in vols.get(mount[0]["name"], {}):
                    E(f"{name}: --{f}={flags[f]} is not on a mounted Secret")
        # Workers drain on SIGTERM for --drain_timeout_s, then 5 s of RPC shutdown.
        if c in WORKERS:
            drain = float(flags.get("drain_timeout_s", 60))
            if drain < LONGEST_REQUEST_S:
                E(f"{name}: --drain_timeout_s {drain} is shorter than the longest request")
            if spec.get("terminationGracePeriodSeconds", 30) < drain + 5:
                E(f"{name}: terminationGracePeriodSeconds does not cover --drain_timeout_s")
        live = main.get("livenessProbe", {})
        if "httpGet" in live and live["httpGet"].get("path") == "/health":
            E(f"{name}: liveness is /health, which asks the router (another service)")
        sp = main.get("startupProbe", {})
        budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        if c in WORKERS and budget < MIN_WORKER_STARTUP_S:
            E(f"{name}: startup budget {budget} s is under {MIN_WORKER_STARTUP_S} s")
        # Non-root, and privileged only with what it implies.
        psc = spec.get("securityContext", {})
        if not psc.get("runAsNonRoot") or psc.get("runAsUser", 0) == 0:
            E(f"{name}: pod does not run as a non-root user")
        for ct in containers(spec):
            sc = ct.get("securityContext", {})
            if sc.get("runAsUser") == 0 and not (ct in spec.get("initContainers", [])
                                                 and ct["name"] == "fetch-weights"):
                E(f"{name}/{ct['name']}: runs as root")
            if sc.get("privileged") and sc.get("allowPrivilegeEscalation") is False:
                E(f"{name}/{ct['name']}: privileged with allowPrivilegeEscalation: false "
                  "(the API server refuses it)")
        # Memory-backed /dev/shm in the workers.
        if c in WORKERS:
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            shm = [m for m in main.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if not shm or vols.get(shm[0]["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
                E(f"{name}: /dev/shm is not a memory-backed emptyDir")
            env = env_of(main)
            pod_ip = env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {})
            if flags.get("advertise_host") != "$(POD_IP)" or pod_ip.get("fieldPath") != "status.podIP":
                E(f"{name}: --advertise_host is not the pod IP from the downward API")
            if flags.get("worker_id") != "$(POD_NAME)":
                E(f"{name}: --worker_id is not the pod name (replicas would collide)")
        # Addresses name the router's Service and its port.
        if c in WORKERS + ["gateway"]:
            target = flags.get("router", "")
            host, _, port = target.rpartition(":")
            svc = services.get(host)
            if svc is None or int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
                E(f"{name}: --router={target} is not the router Service's gRPC port")
        if flags.get("host") != "0.0.0.0":
            E(f"{name}: --host is not 0.0.0.0 (probes and peers could not reach it)")
        # Graceful termination: the gateway drains its longest request.
        if c == "gateway":
            grace = float(flags.get("shutdown_grace_s", 10))
            if grace < LONGEST_REQUEST_S:
                E(f"{name}: --shutdown_grace_s {grace} is shorter than the longest request")
            if spec.get("terminationGracePeriodSeconds", 30) <= grace:
                E(f"{name}: terminationGracePeriodSeconds does not cover --shutdown_grace_s")
            if "preStop" not in main.get("lifecycle", {}):
                E(f"{name}: no preStop (the load balancer would still send connections)")
        # Each process has a PDB that selects it.
        pdbs = [p for p in find(objs, "PodDisruptionBudget")
                if all(labels.get(k) == v
                       for k, v in p["spec"]["selector"]["matchLabels"].items())]
        if not pdbs:
            E(f"{name}: no PodDisruptionBudget selects it")
        # Accelerators per overlay.
        res = main.get("resources", {})
        lim, req = res.get("limits", {}), res.get("requests", {})
        env = env_of(main)
        if c in WORKERS and overlay in GPU_EFA_OVERLAYS:
            if lim.get("nvidia.com/gpu") != "8" or req.get("nvidia.com/gpu") != "8":
                E(f"{name}: does not take 8 nvidia.com/gpu")
            efa = lim.get("vpc.amazonaws.com/efa")
            if efa is None or int(efa) < 1 or req.get("vpc.amazonaws.com/efa") != efa:
                E(f"{name}: does not take the node's EFA devices")
            if not main.get("securityContext", {}).get("privileged"):
                E(f"{name}: not privileged (EFA cannot register GPU memory)")
            for k, v in (("FI_PROVIDER", "efa"), ("FI_EFA_USE_DEVICE_RDMA", "1")):
                if env.get(k, {}).get("value") != v:
                    E(f"{name}: {k} is not {v}")
            if flags.get("tp") != "8" or flags.get("backend") != "cuda":
                E(f"{name}: not --tp=8 --backend=cuda")
            # UCX has no EFA transport: the KV cache would cross over TCP.
            if not (flags.get("kv_transport") or "ucx").startswith("libfabric:efa"):
                E(f"{name}: --kv_transport is not libfabric:efa (UCX would use TCP on EFA)")
            if "/opt/amazon/efa" not in [m["mountPath"] for m in main.get("volumeMounts", [])]:
                E(f"{name}: the node's EFA libfabric (/opt/amazon/efa) is not mounted")
            aff = spec.get("affinity", {}).get("podAffinity", {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution", [])
            if not any(t.get("topologyKey") == "topology.kubernetes.io/zone" for t in aff):
                E(f"{name}: prefill and decode are not held to one availability zone")
            if "hugepages-2Mi" not in lim and env.get("FI_EFA_USE_HUGE_PAGE", {}).get("value") != "0":
                E(f"{name}: EFA hugepages are used but none are requested")
        if c in WORKERS and overlay == "eks-p6-b300":
            if pod["metadata"].get("annotations", {}).get("karpenter.sh/do-not-disrupt") != "true":
                E(f"{name}: no karpenter.sh/do-not-disrupt")
            if spec.get("nodeSelector", {}).get("node.kubernetes.io/instance-type") != "p6-b300.48xlarge":
                E(f"{name}: not pinned to p6-b300.48xlarge")
        if c in WORKERS and overlay == "hyperpod-p6-b300":
            it = spec.get("nodeSelector", {}).get("node.kubernetes.io/instance-type", "")
            if not it.startswith("ml."):
                E(f"{name}: HyperPod instance-type label {it!r} has no ml. prefix")
            if not any(t.get("key") == "sagemaker.amazonaws.com/node-health-status"
                       for t in spec.get("tolerations", [])):
                E(f"{name}: does not tolerate HyperPod's node-health taint")
        if c in WORKERS and overlay == "amd-mi355x":
            if lim.get("amd.com/gpu") != "8":
                E(f"{name}: does not take 8 amd.com/gpu")
            if not any(k.startswith("rdma/") for k in lim):
                E(f"{name}: no RDMA NIC resource")
            if "rc" not in flags.get("ucx_tls", "").split(","):
                E(f"{name}: --ucx_tls has no rc (RoCE) transport")
        if overlay == "cpu-dev":
            if any(k for k in lim if "gpu" in k or "efa" in k):
                E(f"{name}: cpu-dev requests accelerators")
            if env.get("TANDEM_MODEL_DIR", {}).get("value") != "/opt/tandem/models/tiny-seed0":
                E(f"{name}: cpu-dev does not use the tiny checkpoint in the image")
    # The gateway's load balancer outlasts the longest request.
    gw = services.get("tandem-gateway")
    if gw and gw["spec"].get("type") == "LoadBalancer":
        idle = [int(m.group(1)) for v in gw["metadata"].get("annotations", {}).values()
                for m in [re.search(r"idle_timeout\.(?:timeout_)?seconds=(\d+)", v)] if m]
        if not idle or min(idle) <= LONGEST_REQUEST_S:
            E(f"gateway load balancer idle timeout {idle} is not over {LONGEST_REQUEST_S} s")
    # Services select pods and point at their ports.
    for s in services.values():
        sel = s["spec"].get("selector", {})
        targets = [d for d in find(objs, "Deployment")
                   if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                          for k, v in sel.items())]
        if len(targets) != 1:
            E(f"Service {s['metadata']['name']} selects {len(targets)} Deployments")
            continue
        ports = {p["containerPort"] for ct in containers(targets[0]["spec"]["template"]["spec"])
                 for p in ct.get("ports", [])}
        for p in s["spec"]["ports"]:
            if p.get("targetPort", p["port"]) not in ports:
                E(f"Service {s['metadata']['name']} targets port {p.get('targetPort')} "
                  "no container opens")
    # Prometheus can list pods: its account is bound, in its own namespace.
    sa = find(objs, "ServiceAccount", "tandem-prometheus")
    role = find(objs, "ClusterRole", "tandem-prometheus")
    binding = find(objs, "ClusterRoleBinding", "tandem-prometheus")
    if not (sa and role and binding):
        E("Prometheus ServiceAccount/ClusterRole/ClusterRoleBinding missing")
    else:
        rules = role[0]["rules"]
        if not any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules):
            E("Prometheus role cannot list and watch pods")
        subj = binding[0]["subjects"][0]
        if subj["namespace"] != sa[0]["metadata"].get("namespace"):
            E(f"Prometheus binding names namespace {subj['namespace']}, its account is in "
              f"{sa[0]['metadata'].get('namespace')}")
    # The dashboard ConfigMap is deploy/monitoring's dashboard, labelled for Grafana.
    dash = [c for c in find(objs, "ConfigMap")
            if c["metadata"]["name"].startswith("tandem-grafana-dashboard")]
    with open("deploy/monitoring/grafana/tandem.json") as f:
        want = json.load(f)
    if not dash or json.loads(dash[0]["data"].get("tandem.json", "{}")) != want:
        E("Grafana dashboard ConfigMap is not deploy/monitoring/grafana/tandem.json")
    elif dash[0]["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
        E("Grafana dashboard ConfigMap lacks the grafana_dashboard label")
    return errs


def self_test(rendered):
    """Each mutation must make policy_errors report something."""
    eks = rendered["eks-p6-b300"]

    def dep(objs, c):
        return tandem_deployments(objs)[c]["spec"]["template"]

    mutations = {
        "latest tag": lambda o: dep(o, "router")["spec"]["containers"][0].update(image="tandem:latest"),
        "no readiness probe": lambda o: dep(o, "decode")["spec"]["containers"][0].pop("readinessProbe"),
        "probe on another port": lambda o: dep(o, "prefill")["spec"]["containers"][0]["startupProbe"]["exec"]["command"].__setitem__(1, "--address=127.0.0.1:1234"),
        "gRPC probe under mTLS": lambda o: dep(o, "decode")["spec"]["containers"][0].update(
            readinessProbe={"grpc": {"port": 50061}}),
        "probe without the certificate": lambda o: dep(o, "router")["spec"]["containers"][0]["livenessProbe"]["exec"]["command"].pop(),
        "TLS flags off a Secret": lambda o: dep(o, "router")["spec"].update(
            volumes=[v for v in dep(o, "router")["spec"]["volumes"] if v["name"] != "tls"]),
        "grace shorter than the drain": lambda o: dep(o, "decode")["spec"].update(
            terminationGracePeriodSeconds=60),
        "short startup budget": lambda o: dep(o, "decode")["spec"]["containers"][0]["startupProbe"].update(failureThreshold=20),
        "no GPU request": lambda o: dep(o, "prefill")["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu"),
        "no EFA": lambda o: dep(o, "decode")["spec"]["containers"][0]["resources"]["limits"].pop("vpc.amazonaws.com/efa"),
        "not privileged": lambda o: dep(o, "decode")["spec"]["containers"][0]["securityContext"].update(privileged=False),
        "no scrape label": lambda o: dep(o, "gateway")["metadata"]["labels"].pop("app.kubernetes.io/part-of"),
        "no cpu request": lambda o: dep(o, "router")["spec"]["containers"][0]["resources"]["requests"].pop("cpu"),
        "liveness on /health": lambda o: dep(o, "gateway")["spec"]["containers"][0].update(
            livenessProbe={"httpGet": {"path": "/health", "port": 8000}}),
        "shared /dev/shm": lambda o: dep(o, "prefill")["spec"].update(
            volumes=[v for v in dep(o, "prefill")["spec"]["volumes"] if v["name"] != "dshm"]),
        "KV over UCX on EFA": lambda o: dep(o, "prefill")["spec"]["containers"][0].update(
            args=[a for a in dep(o, "prefill")["spec"]["containers"][0]["args"]
                  if not a.startswith("--kv_transport")]),
        "wrong metrics annotation": lambda o: dep(o, "router")["metadata"]["annotations"].update(
            {"prometheus.io/port": "9999"}),
    }
    failures = []
    if policy_errors("eks-p6-b300", copy.deepcopy(eks)):
        failures.append("the unmodified eks-p6-b300 overlay already fails")
    for what, mutate in mutations.items():
        objs = copy.deepcopy(eks)
        mutate(objs)
        errs = policy_errors("eks-p6-b300", objs)
        print(f"self-test: {what}: {'caught: ' + errs[0] if errs else 'NOT CAUGHT'}")
        if not errs:
            failures.append(f"policy does not catch: {what}")
    return failures


def check_policy(argv):
    rendered = render_all()
    errors = []
    if "--self-test" in argv:
        errors += self_test(rendered)
    for o, objs in rendered.items():
        e = policy_errors(o, objs)
        print(f"{o}: {'ok' if not e else f'{len(e)} problem(s)'}")
        errors += e
    if errors:
        fail(errors)


# ------------------------------------------------------------------ schema
def check_schema():
    if shutil.which("node") is None:
        skip("node is not installed (./tandem setup installs nodejs)")
    script = os.path.realpath("tests/deploy/k8s_schema.mjs")
    modules = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(script))),
                           "tools", "node", "node_modules")
    if not os.path.isdir(os.path.join(modules, "kubernetes-models")):
        skip(f"{modules}/kubernetes-models is missing (./tandem setup installs the "
             "pinned npm tools)")
    rendered = render_all()
    objs = [o for objs in rendered.values() for o in objs]
    tmp = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")), "objects.json")
    with open(tmp, "w") as f:
        json.dump(objs, f)
    r = subprocess.run(["node", script, tmp, IEC.rsplit("/", 1)[0] + "/InferenceEndpointConfig"],
                       env=dict(os.environ, TANDEM_NODE_MODULES=modules))
    # The checker itself must reject a broken object.
    bad = copy.deepcopy(find(objs, "Deployment")[0])
    bad["spec"]["replicas"] = "two"
    with open(tmp, "w") as f:
        json.dump([bad], f)
    neg = subprocess.run(["node", script, tmp], capture_output=True, text=True,
                         env=dict(os.environ, TANDEM_NODE_MODULES=modules))
    errors = []
    if r.returncode != 0:
        errors.append("kubernetes-models rejected rendered objects (above)")
    if neg.returncode == 0 or "replicas" not in neg.stdout:
        errors.append(f"kubernetes-models accepted replicas: \"two\": {neg.stdout}")
    if errors:
        fail(errors)


# ------------------------------------------------------------------ CRD
def crd_schema(version):
    with open("deploy/k8s/crds/inferenceendpointconfigs.crd.yaml") as f:
        crd = yaml.safe_load(f)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def structural(schema):
    """The CRD schema as JSON Schema: int-or-string and preserved fields allowed."""
    s = copy.deepcopy(schema)

    def walk(n):
        if isinstance(n, dict):
            if n.get("x-kubernetes-int-or-string"):
                n.pop("type", None)
                n["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            for v in n.values():
                walk(v)
        elif isinstance(n, list):
            for v in n:
                walk(v)

    walk(s)
    return s


def pruned(obj, schema, path=""):
    """Fields the API server would drop (not in the structural schema)."""
    out = []
    if isinstance(obj, dict) and (schema.get("type") == "object" or "properties" in schema):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return out
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        for k, v in obj.items():
            if path == "" and k in ("apiVersion", "kind", "metadata"):
                continue
            if props is not None and k in props:
                out += pruned(v, props[k], f"{path}.{k}")
            elif isinstance(addl, dict):
                out += pruned(v, addl, f"{path}.{k}")
            elif props is not None and addl is not True:
                out.append(f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            out += pruned(v, schema["items"], f"{path}[{i}]")
    return out


def crd_errors(obj):
    import jsonschema
    version = obj["apiVersion"].split("/")[1]
    schema = crd_schema(version)
    validator = jsonschema.Draft7Validator(structural(schema))
    errs = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in validator.iter_errors(obj)]
    errs += [f"{p}: unknown field (the API server would prune it)" for p in pruned(obj, schema)]
    return errs


def check_crd():
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        skip("python3-jsonschema is not installed (./tandem setup installs it)")
    rendered = render_all()
    iecs = [o for objs in rendered.values() for o in objs if kind_id(o) == IEC]
    errors = []
    if not iecs:
        errors.append("no InferenceEndpointConfig rendered")
    for o in iecs:
        e = crd_errors(o)
        print(f"{o['metadata']['name']}: {'valid against the CRD' if not e else e}")
        errors += e
    # The check itself: each broken copy must be refused.
    broken = {
        "instanceType without ml.": lambda w: w["spec"].update(instanceType="p6-b300.48xlarge"),
        "port name not http/grpc": lambda w: w["spec"]["worker"]["modelInvocationPort"].update(name="openai"),
        "no modelVolumeMount": lambda w: w["spec"]["worker"].pop("modelVolumeMount"),
        "misspelt field": lambda w: w["spec"]["worker"].update(enviromentVariables=[]),
        "bad source type": lambda w: w["spec"]["modelSourceConfig"].update(modelSourceType="nfs"),
    }
    for what, mutate in broken.items():
        o = copy.deepcopy(iecs[0]) if iecs else {}
        if not o:
            break
        mutate(o)
        e = crd_errors(o)
        print(f"self-test: {what}: {'refused: ' + e[0] if e else 'ACCEPTED'}")
        if not e:
            errors.append(f"the CRD check accepts: {what}")
    if errors:
        fail(errors)


# ------------------------------------------------------------------ flags
_help_cache = {}


def help_flags(binary):
    """Flag names (underscored) that a binary's --help lists."""
    if binary not in _help_cache:
        r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
        names = set()
        for line in (r.stdout + r.stderr).splitlines():
            m = re.match(r"^\s+--(\[no-?\])?([A-Za-z0-9][A-Za-z0-9_-]*)", line)
            if m:
                names.add(m.group(2).replace("-", "_"))
        _help_cache[binary] = names
    return _help_cache[binary]


def unknown_flags(binary, args):
    known = help_flags(binary)
    bad = []
    for a in args:
        m = re.match(r"^--([A-Za-z0-9_-]+)", a)
        if not m:
            continue
        n = m.group(1).replace("-", "_")
        if n in known or (n.startswith("no") and n[2:].lstrip("_") in known):
            continue
        bad.append(a)
    return bad


def allinone_lines(args):
    """The all-in-one script's three command lines for the given arguments."""
    r = subprocess.run(["bash", SCRIPTS["tandem-allinone"], *args, "--dry-run"],
                       capture_output=True, text=True,
                       env=dict(os.environ, TANDEM_BIN_DIR=BIN_PREFIX.rstrip("/")))
    if r.returncode != 0:
        raise RuntimeError(f"tandem-allinone {args} --dry-run: {r.stderr}")
    out = []
    for line in r.stdout.splitlines():
        role, _, cmd = line.partition(": ")
        out.append((role, cmd.split()))
    return out


def check_flags():
    for b in BINARIES.values():
        if not os.access(b, os.X_OK):
            fail([f"{b} is not built (a data dependency of this test)"])
    for b in BINARIES.values():
        known = help_flags(b)
        # The help text was read: the flags every Tandem process has are there.
        for must in ("model", "port", "log_format"):
            if must not in known:
                fail([f"{b} --help does not list --{must}: cannot parse its help"])
        if unknown_flags(b, ["--no_such_flag_18=1"]) != ["--no_such_flag_18=1"]:
            fail([f"{b}: the check accepts a flag the binary does not have"])
    rendered = render_all()
    errors = []
    checked = 0

    def check(where, command, args):
        nonlocal checked
        prog = os.path.basename(command)
        if prog in BINARIES:
            bad = unknown_flags(BINARIES[prog], args)
            checked += len(args)
            for a in bad:
                errors.append(f"{where}: {prog} has no flag {a}")
        elif prog == "tandem-allinone":
            for role, cmd in allinone_lines(args):
                check(f"{where} (tandem-allinone {role})", cmd[0], cmd[1:])
        elif prog == "tandem-fetch-weights":
            if len(args) != 2 or any(a.startswith("-") for a in args):
                errors.append(f"{where}: tandem-fetch-weights takes SRC DST, got {args}")
        else:
            errors.append(f"{where}: {command} is not a Tandem program")

    for o, objs in rendered.items():
        for obj in objs:
            if obj["kind"] == "Deployment":
                for ct in containers(obj["spec"]["template"]["spec"]):
                    cmd = ct.get("command", [])
                    if cmd and cmd[0].startswith(BIN_PREFIX):
                        check(f"{o}/{obj['metadata']['name']}/{ct['name']}", cmd[0],
                              ct.get("args", []))
                    elif ct["image"].startswith("tandem"):
                        errors.append(f"{o}/{obj['metadata']['name']}/{ct['name']}: "
                                      "Tandem container without a /opt/tandem/bin command")
            elif kind_id(obj) == IEC:
                w = obj["spec"]["worker"]
                check(f"{o}/{obj['metadata']['name']}", w["command"][0], w.get("args", []))
    print(f"{checked} flags checked against the binaries' --help")
    if errors:
        fail(errors)


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    # Run from the runfiles root (Bazel) or the repository root.
    ws = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
    if os.environ.get("TEST_SRCDIR") and os.path.isdir(ws):
        os.chdir(ws)
    {
        "render": lambda: check_render(),
        "policy": lambda: check_policy(argv[2:]),
        "schema": lambda: check_schema(),
        "crd": lambda: check_crd(),
        "flags": lambda: check_flags(),
    }[argv[1]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
