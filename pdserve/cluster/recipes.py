"""Pre-flight check of a deployment recipe: do a pdserve config's pools fit on the
nodes that a Ray cluster-launcher config (``ray up``) or a KubeRay manifest brings up?

``pdserve serve`` checks its pools against the running Ray cluster when it starts
(``Cluster._check_resources``). This does the same from the YAML files, before any
machine exists, and node by node as Ray places actors (one worker's CPUs, GPUs and
custom resources all on one node, with the pool's labels), so a misspelt resource
name, a pool larger than its node group or a group without GPUs shows up before
``ray up`` or ``kubectl apply`` starts paying for GPU nodes::

    python -m pdserve.cluster.recipes --config deploy/ray/pdserve.yaml \\
        --ray-cluster deploy/ray/cluster.yaml
    python -m pdserve.cluster.recipes --kuberay deploy/kuberay/raycluster.yaml

Counted are the nodes present when pdserve starts: the head plus ``min_workers`` of
each launcher node type, or each KubeRay group's ``replicas``; pdserve does not wait
for an autoscaler. A launcher node type's resources are its ``resources`` over the
``--resources``/``--num-cpus``/``--num-gpus`` of the start commands (as ``ray start``
merges them); a KubeRay group's are ``rayStartParams`` (``resources`` as the JSON
string KubeRay passes on), the group's ``resources`` map, else the Ray container's
``cpu`` / ``nvidia.com/gpu`` limits. The files are only read: nothing starts, no
cloud API is called.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.cluster.config import ClusterConfig

KUBERAY_KINDS = ("RayCluster", "RayJob", "RayService")
_EPS = 1e-9


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one kind: ``count`` of them up when pdserve starts, each with
    ``resources`` (Ray's names: CPU, GPU, custom) and Ray node ``labels``."""

    name: str
    count: int
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- the placement check

def pool_problems(config: ClusterConfig, groups: Sequence[NodeGroup]) -> list[str]:
    """What keeps ``config``'s pools from starting on ``groups`` ([] = they fit).

    Workers are placed one at a time on the first node with the pool's labels that
    still has the worker's whole bundle, pools in the order prefill, decode,
    colocated; a shortfall names the pool and the resource (or label) missing."""
    has_gpus = any(g.count > 0 and g.resources.get("GPU", 0) > 0 for g in groups)
    free = [(g, dict(g.resources)) for g in groups for _ in range(g.count)]
    pools = {"prefill": config.prefill, "decode": config.decode,
             "colocated": config.colocated_pool}
    problems: list[str] = []
    for role, pool in pools.items():
        if not pool.workers:
            continue
        bundle = pool.bundle(has_gpus)
        nodes = [(g, res) for g, res in free
                 if all(g.labels.get(k) == v for k, v in pool.labels.items())]
        if not nodes:
            seen = sorted({f"{k}={v}" for g in groups for k, v in g.labels.items()})
            problems.append(f"{role} pool: no node has the labels {pool.labels} "
                            f"(labels of the node groups: {seen or 'none'})")
            continue
        short = _shortfall(role, pool.workers, bundle, nodes, groups)
        if short:
            problems.append(short)
            continue
        for placed in range(pool.workers):
            spot = next((res for _, res in nodes
                         if all(res.get(r, 0) + _EPS >= a for r, a in bundle.items())), None)
            if spot is None:
                problems.append(
                    f"{role} pool: {placed} of {pool.workers} workers fit; one worker needs "
                    f"{_fmt(bundle)} on a single node and no node has that left "
                    f"({_fmt_groups(groups)})")
                break
            for r, a in bundle.items():
                spot[r] = spot.get(r, 0) - a
    return problems


def _shortfall(role: str, workers: int, bundle: dict[str, float],
               nodes: list[tuple[NodeGroup, dict[str, float]]],
               groups: Sequence[NodeGroup]) -> str | None:
    """The first resource the pool's nodes lack in total, as a message: custom
    resources (what pins the pool) first, then CPU and GPU on the nodes that have
    the custom ones."""
    custom = [r for r in bundle if r not in ("CPU", "GPU")]
    for res in custom:
        have = sum(r.get(res, 0) for _, r in nodes)
        if have + _EPS < bundle[res] * workers:
            by = [f"{g.name} ({g.count} x {g.resources[res]:g})" for g in groups
                  if g.resources.get(res, 0) > 0]
            where = ("advertised by " + ", ".join(by)) if by else \
                f"advertised by no node group ({', '.join(g.name for g in groups)})"
            return (f"{role} pool: not enough {res}: {workers} workers x {bundle[res]:g} = "
                    f"{bundle[res] * workers:g}, the nodes up at start have {have:g} left; "
                    f"{res} is {where}")
    pinned = [(g, r) for g, r in nodes if all(r.get(c, 0) > _EPS for c in custom)]
    for res in ("CPU", "GPU"):
        if res not in bundle:
            continue
        have = sum(r.get(res, 0) for _, r in pinned)
        if have + _EPS < bundle[res] * workers:
            names = sorted({g.name for g, _ in pinned})
            on = f" with {', '.join(custom)}" if custom else ""
            return (f"{role} pool: not enough {res}: {workers} workers x {bundle[res]:g} = "
                    f"{bundle[res] * workers:g}, the nodes{on} up at start "
                    f"({', '.join(names) or 'none'}) have {have:g} left")
    return None


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _fmt_groups(groups: Sequence[NodeGroup]) -> str:
    return "; ".join(f"{g.name}: {g.count} x {_fmt(g.resources)}" for g in groups)


# ---------------------------------------------------------------- Ray cluster launcher

def ray_schema_problems(cluster: dict[str, Any]) -> list[str]:
    """``cluster`` against the schema ``ray up`` validates with (Ray's own
    ``ray/autoscaler/ray-schema.json``), plus the cross-field rules it enforces."""
    import jsonschema
    import ray.autoscaler

    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    problems = [f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
                for e in sorted(validator.iter_errors(cluster), key=lambda e: str(list(e.path)))]
    if problems:
        return problems
    types = cluster.get("available_node_types") or {}
    head = cluster.get("head_node_type")
    if types and head not in types:
        problems.append(f"head_node_type {head!r} is not one of available_node_types "
                        f"{sorted(types)}")
    for name, t in types.items():
        if isinstance(t, dict) and t.get("min_workers", 0) > t.get("max_workers", 1 << 31):
            problems.append(f"available_node_types.{name}: min_workers > max_workers")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        try:
            _start_flags(cluster.get(key) or [])
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    return problems


def ray_launcher_groups(cluster: dict[str, Any]) -> list[NodeGroup]:
    """The node groups of a launcher config at start: the head, and ``min_workers``
    of every other node type."""
    head = cluster.get("head_node_type")
    head_res, head_labels = _start_flags(cluster.get("head_start_ray_commands") or [])
    worker_res, worker_labels = _start_flags(cluster.get("worker_start_ray_commands") or [])
    out = []
    for name, t in (cluster.get("available_node_types") or {}).items():
        is_head = name == head
        res, labels = (head_res, head_labels) if is_head else (worker_res, worker_labels)
        # The node type's own values win: the launcher exports them as
        # RAY_OVERRIDE_RESOURCES / RAY_OVERRIDE_LABELS, which override the flags.
        out.append(NodeGroup(
            name, 1 if is_head else int(t.get("min_workers", 0)),
            {**res, **{k: float(v) for k, v in (t.get("resources") or {}).items()}},
            {**labels, **(t.get("labels") or {})}))
    return out


def _start_flags(commands: Iterable[str]) -> tuple[dict[str, float], dict[str, str]]:
    """Resources and labels set by ``--resources``, ``--num-cpus``, ``--num-gpus`` and
    ``--labels`` in ``ray start`` command lines (``ValueError`` if unreadable)."""
    resources: dict[str, float] = {}
    labels: dict[str, str] = {}
    for command in commands:
        try:
            tokens = shlex.split(command)
        except ValueError as exc:
            raise ValueError(f"cannot split {command!r}: {exc}") from None
        for i, tok in enumerate(tokens):
            flag, eq, value = tok.partition("=")
            if flag not in ("--resources", "--num-cpus", "--num-gpus", "--labels"):
                continue
            if not eq:
                if i + 1 >= len(tokens):
                    raise ValueError(f"{flag} without a value in {command!r}")
                value = tokens[i + 1]
            value = value.rstrip(";")
            if flag == "--resources":
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"--resources is not JSON ({exc}): {value!r}") from None
                if not isinstance(parsed, dict):
                    raise ValueError(f"--resources must be a JSON object: {value!r}")
                resources.update({str(k): float(v) for k, v in parsed.items()})
            elif flag == "--labels":
                labels.update(_parse_labels(value))
            else:
                resources["CPU" if flag == "--num-cpus" else "GPU"] = float(value)
    return resources, labels


def _parse_labels(value: str) -> dict[str, str]:
    """``ray start --labels`` syntax: ``key=value,key2=value2``."""
    out = {}
    for pair in filter(None, (p.strip() for p in value.strip("\"'").split(","))):
        key, eq, val = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--labels takes key=value pairs, got {pair!r}")
        out[key.strip()] = val.strip()
    return out


# ---------------------------------------------------------------- KubeRay

def kuberay_cluster_spec(docs: Sequence[Any]) -> tuple[str, dict[str, Any]]:
    """(name, RayClusterSpec) of the first RayCluster, RayJob or RayService."""
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") in KUBERAY_KINDS:
            spec = doc.get("spec") or {}
            cluster = {"RayCluster": spec, "RayJob": spec.get("rayClusterSpec"),
                       "RayService": spec.get("rayClusterConfig")}[doc["kind"]]
            if cluster:
                return str((doc.get("metadata") or {}).get("name", "")), cluster
    raise ValueError("no RayCluster (or RayJob / RayService with a cluster spec) in the "
                     "manifest")


def kuberay_groups(spec: dict[str, Any]) -> list[NodeGroup]:
    """The head and worker groups of a RayClusterSpec (workers: ``replicas``, else
    ``minReplicas``, times ``numOfHosts``)."""
    out = [_kuberay_group("head", 1, spec.get("headGroupSpec") or {})]
    for g in spec.get("workerGroupSpecs") or []:
        replicas = g.get("replicas", g.get("minReplicas", 0)) or 0
        out.append(_kuberay_group(str(g.get("groupName", "")),
                                  int(replicas) * int(g.get("numOfHosts", 1) or 1), g))
    return out


def _kuberay_group(name: str, count: int, group: dict[str, Any]) -> NodeGroup:
    params = {k: str(v) for k, v in (group.get("rayStartParams") or {}).items()}
    resources = _kuberay_resources_param(params.get("resources"))
    for key, qty in (group.get("resources") or {}).items():
        low = key.lower()
        if low == "cpu":
            resources["CPU"] = _quantity(qty)
        elif low.endswith("gpu"):
            resources["GPU"] = _quantity(qty)
        elif low != "memory":
            resources[key] = _quantity(qty)
    container = _ray_container(group)
    limits = {**((container.get("resources") or {}).get("requests") or {}),
              **((container.get("resources") or {}).get("limits") or {})}
    if "num-cpus" in params:
        resources["CPU"] = float(params["num-cpus"])
    elif "CPU" not in resources and "cpu" in limits:
        resources["CPU"] = float(int(_quantity(limits["cpu"])))  # KubeRay rounds down
    if "num-gpus" in params:
        resources["GPU"] = float(params["num-gpus"])
    elif "GPU" not in resources:
        gpus = sum(_quantity(v) for k, v in limits.items() if k.lower().endswith("gpu"))
        if gpus:
            resources["GPU"] = gpus
    return NodeGroup(name, count, resources, dict(group.get("labels") or {}))


def _kuberay_resources_param(value: str | None) -> dict[str, float]:
    """rayStartParams ``resources``: a JSON object in a string, quoted for the shell
    (``'"{\\"prefill_node\\": 1}"'``); KubeRay strips the quotes the same way."""
    if value is None:
        return {}
    text = value.strip("'\"` ").replace('\\"', '"')
    parsed = json.loads(text)
    if not isinstance(parsed, dict):
        raise ValueError(f"rayStartParams resources must be a JSON object, got {value!r}")
    return {str(k): float(v) for k, v in parsed.items()}


def _ray_container(group: dict[str, Any]) -> dict[str, Any]:
    containers = (((group.get("template") or {}).get("spec") or {}).get("containers")) or [{}]
    return containers[0] or {}  # KubeRay: the Ray container is the first one


def _quantity(value: Any) -> float:
    """A Kubernetes quantity of CPUs or devices: 8, "8", "500m", "1.5"."""
    text = str(value).strip()
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


def kuberay_problems(docs: Sequence[Any], config: ClusterConfig | None = None) -> list[str]:
    """What KubeRay (>= 1.5) would refuse or pdserve cannot use in the manifest:
    group names, replica bounds, rayStartParams, GPU limits, and with ``config``
    whether a Service reaches the router's ports on the head."""
    problems = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") in KUBERAY_KINDS \
                and doc.get("apiVersion") != "ray.io/v1":
            problems.append(f"{doc['kind']}: apiVersion must be ray.io/v1, got "
                            f"{doc.get('apiVersion')!r}")
    try:
        name, spec = kuberay_cluster_spec(docs)
    except ValueError as exc:
        return [*problems, str(exc)]
    groups = [("head", spec.get("headGroupSpec") or {})]
    seen = set()
    for g in spec.get("workerGroupSpecs") or []:
        gname = str(g.get("groupName") or "")
        if not gname or gname in seen:
            problems.append(f"worker group names must be unique and set, got {gname!r}")
        seen.add(gname)
        groups.append((gname, g))
        lo, hi, n = g.get("minReplicas"), g.get("maxReplicas"), g.get("replicas")
        if not spec.get("enableInTreeAutoscaling") and (lo is None or hi is None):
            problems.append(f"group {gname}: minReplicas and maxReplicas are required "
                            "without the autoscaler")
        if lo is not None and hi is not None and not lo <= (n if n is not None else lo) <= hi:
            problems.append(f"group {gname}: needs minReplicas <= replicas <= maxReplicas, "
                            f"got {lo} <= {n} <= {hi}")
    for gname, g in groups:
        params = g.get("rayStartParams") or {}
        bad = sorted(k for k, v in params.items() if not isinstance(v, str))
        if bad:
            problems.append(f"group {gname}: rayStartParams values must be strings: {bad}")
        if "labels" in params:
            problems.append(f"group {gname}: rayStartParams 'labels' is refused by KubeRay; "
                            "use the group's top-level labels")
        if g.get("resources") and any(k in params for k in
                                      ("num-cpus", "num-gpus", "memory", "resources")):
            problems.append(f"group {gname}: resources in both rayStartParams and the "
                            "group's resources map")
        try:
            _kuberay_resources_param(params.get("resources"))
        except (ValueError, json.JSONDecodeError) as exc:
            problems.append(f"group {gname}: rayStartParams resources is not a JSON "
                            f"object: {exc}")
            continue
        node = _kuberay_group(gname, 1, g)
        limits = (_ray_container(g).get("resources") or {}).get("limits") or {}
        if node.resources.get("GPU", 0) > 0 and not any(
                k.lower().endswith("gpu") for k in limits):
            problems.append(f"group {gname}: advertises GPUs but its Ray container has no "
                            "GPU limit (nvidia.com/gpu)")
    if config is not None:
        problems += _service_problems(docs, name, config)
    return problems


def _service_problems(docs: Sequence[Any], cluster: str, config: ClusterConfig) -> list[str]:
    if config.host in ("127.0.0.1", "localhost", "::1"):
        return [f"the pdserve config binds host {config.host}: no Service can reach the "
                "router; use host: 0.0.0.0"]
    services = [d for d in docs if isinstance(d, dict) and d.get("kind") == "Service"
                and (d.get("spec") or {}).get("selector", {}).get("ray.io/node-type") == "head"
                and (d["spec"]["selector"].get("ray.io/cluster") in (None, cluster))]
    if not services:
        return [f"no Service selects the head Pod of RayCluster {cluster!r} "
                "(selector ray.io/cluster + ray.io/node-type: head)"]
    ports = {p.get("targetPort", p.get("port")) for s in services
             for p in s["spec"].get("ports") or []}
    return [f"no Service port targets the router's {what} {port}"
            for what, port in (("http_port", config.http_port), ("grpc_port", config.grpc_port))
            if port not in ports]


def kuberay_embedded_config(docs: Sequence[Any], key: str = "pdserve.yaml") -> ClusterConfig:
    """The pdserve config a ConfigMap of the manifest carries under ``key``."""
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap" \
                and key in (doc.get("data") or {}):
            return ClusterConfig.from_dict(yaml.safe_load(doc["data"][key]) or {})
    raise ValueError(f"no ConfigMap with a {key!r} key in the manifest")


# ---------------------------------------------------------------- files, command line

def check_ray_launcher(cluster_path: str | Path, config_path: str | Path) -> list[str]:
    """Problems of a launcher config + pdserve config pair ([] = fine)."""
    cluster = yaml.safe_load(Path(cluster_path).read_text()) or {}
    config = ClusterConfig.load(config_path, {})
    problems = ray_schema_problems(cluster)
    if problems:
        return problems
    return pool_problems(config, ray_launcher_groups(cluster))


def check_kuberay(manifest_path: str | Path, config_path: str | Path | None = None) -> list[str]:
    """Problems of a KubeRay manifest with its pdserve config (``config_path``, else
    the manifest's ConfigMap)."""
    docs = [d for d in yaml.safe_load_all(Path(manifest_path).read_text()) if d]
    config = (ClusterConfig.load(config_path, {}) if config_path is not None
              else kuberay_embedded_config(docs))
    problems = kuberay_problems(docs, config)
    if problems:
        return problems
    return pool_problems(config, kuberay_groups(kuberay_cluster_spec(docs)[1]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.cluster.recipes",
                                description="check that a pdserve config's pools fit the "
                                            "nodes of a Ray cluster-launcher config or a "
                                            "KubeRay manifest")
    p.add_argument("--config", help="pdserve YAML config (KubeRay: default the manifest's "
                                    "ConfigMap key pdserve.yaml)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--ray-cluster", help="Ray cluster-launcher YAML (ray up)")
    which.add_argument("--kuberay", help="KubeRay manifest (RayCluster / RayJob / RayService)")
    args = p.parse_args(argv)
    try:
        if args.ray_cluster:
            if not args.config:
                p.error("--ray-cluster needs --config")
            problems = check_ray_launcher(args.ray_cluster, args.config)
        else:
            problems = check_kuberay(args.kuberay, args.config)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in problems:
        print(line)
    if not problems:
        print("ok: the pools fit the nodes up at start")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
