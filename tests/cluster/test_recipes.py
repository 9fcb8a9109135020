"""The deploy recipes (deploy/ray/, deploy/kuberay/) are valid and consistent: the
launcher config passes Ray's own schema, the pdserve configs load with pdserve's
loader, every pool fits the nodes its recipe starts, the job script and the RayJob
run a `pdserve serve` that pdserve's CLI accepts, and the commands in docs/deploy.md
exist. The negative tests break a loaded copy and expect the checker
(pdserve.cluster.recipes) to name what is missing."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli.main import _cluster_config, build_parser
from pdserve.cluster import recipes
from pdserve.cluster.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "deploy/ray/cluster.yaml"
PDSERVE_YAML = ROOT / "deploy/ray/pdserve.yaml"
JOB_SH = ROOT / "deploy/ray/job.sh"
KUBERAY_YAML = ROOT / "deploy/kuberay/raycluster.yaml"
DEPLOY_MD = ROOT / "docs/deploy.md"
POOLS = ("prefill", "decode")
# Importing Ray's CLI (ray_cli_parse) imports Ray Serve, whose models warn under Pydantic 2.
pytestmark = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")


def launcher() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def kuberay_docs() -> list[Any]:
    return [d for d in yaml.safe_load_all(KUBERAY_YAML.read_text()) if d]


def kind(docs: list[Any], name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == name]
    return doc


def pdserve_config() -> ClusterConfig:
    return ClusterConfig.load(PDSERVE_YAML, {})


def ray_cli_parse(argv: list[str]) -> str:
    """Parse a ``ray`` command line with Ray's own click CLI without running it (an
    unknown flag or subcommand raises); returns the subcommand's name."""
    import warnings

    import click
    from ray.scripts.scripts import cli

    cmd: click.Command = cli
    name = "ray"
    while isinstance(cmd, click.Group):
        ctx = cmd.make_context(name, list(argv))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            rest = [*ctx.protected_args, *ctx.args]
        sub_name, sub, argv = cmd.resolve_command(ctx, rest)
        assert sub is not None and sub_name is not None
        cmd, name = sub, sub_name
    cmd.make_context(name, list(argv))
    return name


# ---------------------------------------------------------------- Ray cluster launcher

def test_cluster_yaml_passes_rays_schema_and_config_preparation() -> None:
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = launcher()
    jsonschema.validate(cluster, schema)
    assert recipes.ray_schema_problems(cluster) == []
    # What `ray up` does before it calls AWS: fill in the provider's defaults, validate.
    validate_config(prepare_config(copy.deepcopy(cluster)))
    assert cluster["provider"]["type"] == "aws"
    types = cluster["available_node_types"]
    assert set(types) == {cluster["head_node_type"], *POOLS}
    assert types[cluster["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert any("ray start --head" in c for c in cluster["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c
               for c in cluster["worker_start_ray_commands"])


def test_node_types_advertise_their_pool_and_valid_ray_labels() -> None:
    from ray._private.label_utils import validate_node_label_syntax

    types = launcher()["available_node_types"]
    for pool in POOLS:
        assert types[pool]["resources"][f"{pool}_node"] == types[pool]["resources"]["GPU"] > 0
        assert types[pool]["labels"] == {"pdserve/pool": pool}
        validate_node_label_syntax(types[pool]["labels"])
        other = next(p for p in POOLS if p != pool)
        assert f"{other}_node" not in types[pool]["resources"]


def test_pdserve_yaml_loads_and_pins_each_pool() -> None:
    c = pdserve_config()
    assert c.transfer == "nixl"
    assert c.host == "0.0.0.0" and (c.http_port, c.grpc_port) == (8000, 50051)
    assert c.api_key is not None or c.api_key_file is not None
    assert c.file_sd_path is not None and c.file_sd_path.endswith(".json")
    for pool in POOLS:
        p = getattr(c, pool)
        assert p.workers > 0 and p.num_gpus == 1
        assert p.resources == {f"{pool}_node": 1}
    assert c.colocated_pool.workers == 0


def test_pdserve_yaml_unknown_keys_fail(tmp_path: Path) -> None:
    data = yaml.safe_load(PDSERVE_YAML.read_text())
    data["decode"]["resource"] = {"decode_node": 1}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="unknown key"):
        ClusterConfig.load(tmp_path / "c.yaml", {})


def test_ray_recipe_pools_fit_the_nodes_up_at_start() -> None:
    assert recipes.check_ray_launcher(CLUSTER_YAML, PDSERVE_YAML) == []
    groups = {g.name: g for g in recipes.ray_launcher_groups(launcher())}
    c = pdserve_config()
    for pool in POOLS:
        g, p = groups[pool], getattr(c, pool)
        res = f"{pool}_node"
        assert g.count * g.resources[res] >= p.workers * p.resources[res]
        assert g.count * g.resources["GPU"] >= p.workers * (p.num_gpus or 0)
        assert g.count * g.resources["CPU"] >= p.workers * p.num_cpus
        assert g.labels == {"pdserve/pool": pool}


def test_ray_recipe_missing_resource_is_named() -> None:
    c = pdserve_config()
    cluster = launcher()
    res = cluster["available_node_types"]["decode"]["resources"]
    res["decode_nodes"] = res.pop("decode_node")  # a typo in the node type
    (problem,) = recipes.pool_problems(c, recipes.ray_launcher_groups(cluster))
    assert problem.startswith("decode pool: not enough decode_node:")
    assert "advertised by no node group" in problem

    cluster = launcher()
    cluster["available_node_types"]["prefill"]["min_workers"] = 0  # only max_workers
    (problem,) = recipes.pool_problems(c, recipes.ray_launcher_groups(cluster))
    assert "prefill pool: not enough" in problem and "prefill (0 x" in problem

    bigger = ClusterConfig.from_dict({**yaml.safe_load(PDSERVE_YAML.read_text()),
                                      "decode": {"workers": 9, "num_cpus": 8, "num_gpus": 1,
                                                 "resources": {"decode_node": 1}}})
    (problem,) = recipes.pool_problems(bigger, recipes.ray_launcher_groups(launcher()))
    assert problem.startswith("decode pool: not enough decode_node: 9 workers x 1 = 9, the "
                              "nodes up at start have 8 left")
    bigger = ClusterConfig.from_dict({**yaml.safe_load(PDSERVE_YAML.read_text()),
                                      "decode": {"workers": 8, "num_cpus": 8, "num_gpus": 2,
                                                 "resources": {"decode_node": 1}}})
    (problem,) = recipes.pool_problems(bigger, recipes.ray_launcher_groups(launcher()))
    assert problem == ("decode pool: not enough GPU: 8 workers x 2 = 16, the nodes with "
                       "decode_node up at start (decode) have 8 left")


def test_checker_places_per_node_and_reads_start_flags() -> None:
    c = pdserve_config()
    cluster = launcher()
    # Enough CPUs in all (6 x 12 >= 8 x 8), but a decode node holds one worker's 8 only.
    cluster["available_node_types"]["decode"]["resources"]["CPU"] = 12
    cluster["available_node_types"]["decode"]["min_workers"] = 6
    problems = recipes.pool_problems(c, recipes.ray_launcher_groups(cluster))
    assert problems and problems[0].startswith("decode pool: 6 of 8 workers fit; one worker "
                                               "needs {CPU: 8, GPU: 1, decode_node: 1}")

    # Resources and labels from the `ray start` flags count as well (node type wins).
    cluster = launcher()
    cluster["available_node_types"]["decode"]["resources"] = {"CPU": 192, "GPU": 8}
    cluster["available_node_types"]["decode"].pop("labels")
    cluster["worker_start_ray_commands"][-1] += (
        " --resources='{\"decode_node\": 8}' --labels pdserve/pool=decode")
    assert recipes.ray_schema_problems(cluster) == []
    groups = {g.name: g for g in recipes.ray_launcher_groups(cluster)}
    assert groups["decode"].resources["decode_node"] == 8
    assert groups["decode"].labels == {"pdserve/pool": "decode"}
    assert recipes.pool_problems(c, list(groups.values())) == []

    cluster["worker_start_ray_commands"][-1] += " --resources '{bad'"
    assert any("--resources is not JSON" in p for p in recipes.ray_schema_problems(cluster))


def test_pool_labels_must_match_a_node() -> None:
    data = yaml.safe_load(PDSERVE_YAML.read_text())
    data["decode"]["labels"] = {"pdserve/pool": "decode"}
    groups = recipes.ray_launcher_groups(launcher())
    assert recipes.pool_problems(ClusterConfig.from_dict(data), groups) == []
    data["decode"]["labels"] = {"pdserve/pool": "decoder"}
    (problem,) = recipes.pool_problems(ClusterConfig.from_dict(data), groups)
    assert problem.startswith("decode pool: no node has the labels")
    assert "pdserve/pool=decode" in problem


def test_schema_violation_is_reported() -> None:
    cluster = launcher()
    cluster["available_node_types"]["decode"]["resources"]["decode_node"] = 0.5  # ints only
    cluster["available_node_types"]["prefill"]["gpus"] = 8
    problems = recipes.ray_schema_problems(cluster)
    assert any("decode_node" in p for p in problems)
    assert any("gpus" in p for p in problems)


def test_recipes_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert recipes.main(["--config", str(PDSERVE_YAML), "--ray-cluster", str(CLUSTER_YAML)]) == 0
    assert recipes.main(["--kuberay", str(KUBERAY_YAML)]) == 0
    cluster = launcher()
    cluster["available_node_types"]["prefill"]["min_workers"] = 0
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    capsys.readouterr()
    assert recipes.main(["--config", str(PDSERVE_YAML),
                         "--ray-cluster", str(tmp_path / "cluster.yaml")]) == 1
    assert "prefill pool: not enough" in capsys.readouterr().out


# ---------------------------------------------------------------- the job script

def job_command(*args: str, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run(["bash", str(JOB_SH), "--dry-run", *args], capture_output=True,
                         text=True, check=True, cwd="/", env={"PATH": "/usr/bin:/bin",
                                                             **(env or {})})
    return shlex.split(out.stdout)


def test_job_script_submits_pdserve_serve_with_a_runtime_env() -> None:
    subprocess.run(["bash", "-n", str(JOB_SH)], check=True)
    assert JOB_SH.stat().st_mode & 0o111, "job.sh is executable"
    cmd = job_command("--policy", "least_loaded")
    assert cmd[:3] == ["ray", "job", "submit"]
    sep = cmd.index("--")
    submit, entry = cmd[:sep], cmd[sep + 1:]
    assert ray_cli_parse(cmd[1:]) == "submit"
    runtime_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert runtime_env["working_dir"] == "."  # the script runs it from the repository root
    assert runtime_env["env_vars"]["NIXL_LOG_LEVEL"] == "WARN"
    # pdserve's own parser takes the entrypoint, and the config it names loads.
    args = build_parser().parse_args(entry[1:])
    assert entry[0] == "pdserve" and args.command == "serve" and args.address == "auto"
    assert (ROOT / args.config).resolve() == PDSERVE_YAML
    config = _cluster_config(args)
    assert config.address == "auto" and config.router.policy == "least_loaded"
    assert config.prefill == pdserve_config().prefill
    # The upload keeps the config and leaves out the package the nodes have installed.
    from ray._private.thirdparty.pathspec import PathSpec

    excluded = PathSpec.from_lines("gitwildmatch", runtime_env["excludes"])
    assert not excluded.match_file(args.config)
    assert excluded.match_file("pdserve/cli/main.py")


def test_job_script_passes_ucx_settings_and_refuses_a_missing_config() -> None:
    cmd = job_command(env={"UCX_TLS": "tcp,cuda_copy", "UCX_NET_DEVICES": "eth0"})
    env = json.loads(cmd[cmd.index("--runtime-env-json") + 1])["env_vars"]
    assert env["UCX_TLS"] == "tcp,cuda_copy" and env["UCX_NET_DEVICES"] == "eth0"
    out = subprocess.run(["bash", str(JOB_SH), "--dry-run"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PDSERVE_CONFIG": "deploy/nope.yaml"})
    assert out.returncode == 2 and "no config at deploy/nope.yaml" in out.stderr


# ---------------------------------------------------------------- KubeRay

def test_kuberay_manifest_shape() -> None:
    docs = kuberay_docs()
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "RayCluster", "RayJob", "Service"]
    rc = kind(docs, "RayCluster")
    assert rc["apiVersion"] == kind(docs, "RayJob")["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(POOLS)
    for pool, g in groups.items():
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        params = g["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values())
        # The shell-quoted JSON string form KubeRay passes to `ray start --resources`.
        assert params["resources"].startswith('"{') and params["resources"].endswith('}"')
        assert recipes._kuberay_resources_param(params["resources"]) == {f"{pool}_node": 1.0}
        assert "labels" not in params and g["labels"] == {"pdserve/pool": pool}
        container = g["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["UCX_TLS"] and env["UCX_NET_DEVICES"]
    assert recipes.kuberay_problems(docs, recipes.kuberay_embedded_config(docs)) == []


def test_kuberay_pools_fit_and_ports_match() -> None:
    docs = kuberay_docs()
    config = recipes.kuberay_embedded_config(docs)  # through pdserve's config loader
    assert config.transfer == "nixl" and config.host == "0.0.0.0"
    assert recipes.check_kuberay(KUBERAY_YAML) == []
    groups = {g.name: g for g in recipes.kuberay_groups(kind(docs, "RayCluster")["spec"])}
    for pool in POOLS:
        g, p = groups[pool], getattr(config, pool)
        assert g.count * g.resources[f"{pool}_node"] >= p.workers * p.resources[f"{pool}_node"]
        assert g.resources["GPU"] >= (p.num_gpus or 0) and g.resources["CPU"] >= p.num_cpus
    assert groups["head"].resources == {"CPU": 0.0}
    svc = kind(docs, "Service")
    ports = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
    assert (ports["http"], ports["grpc"]) == (config.http_port, config.grpc_port)
    assert svc["spec"]["selector"] == {"ray.io/cluster": "pdserve", "ray.io/node-type": "head"}
    head = kind(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    declared = {p["containerPort"] for p in head["ports"]}
    assert {config.http_port, config.grpc_port} <= declared


def test_kuberay_rayjob_runs_pdserve_serve_on_the_cluster() -> None:
    docs = kuberay_docs()
    job, rc = kind(docs, "RayJob"), kind(docs, "RayCluster")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": rc["metadata"]["name"]}
    entry = shlex.split(job["spec"]["entrypoint"])
    args = build_parser().parse_args(entry[1:])
    assert entry[0] == "pdserve" and args.command == "serve" and args.address == "auto"
    yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    # --config is the ConfigMap's key where the head mounts it.
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in head["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    config_path = Path(args.config)
    volume = volumes[mounts[str(config_path.parent)]]
    cm = kind(docs, "ConfigMap")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert config_path.name in cm["data"]
    # The API key file and the file-SD folder are mounted on the head; Prometheus reads it.
    config = recipes.kuberay_embedded_config(docs)
    assert config.api_key_file is not None and config.file_sd_path is not None
    assert str(Path(config.api_key_file).parent) in mounts
    targets = mounts[str(Path(config.file_sd_path).parent)]
    prom = head["containers"][1]
    assert {m["name"]: m["mountPath"] for m in prom["volumeMounts"]}[targets] \
        == "/etc/prometheus/targets"


def test_kuberay_broken_copies_are_reported() -> None:
    docs = kuberay_docs()
    config = recipes.kuberay_embedded_config(docs)

    def groups(d: list[Any]) -> list[recipes.NodeGroup]:
        return recipes.kuberay_groups(kind(d, "RayCluster")["spec"])

    broken = copy.deepcopy(docs)
    decode = kind(broken, "RayCluster")["spec"]["workerGroupSpecs"][1]
    decode["replicas"] = decode["minReplicas"] = 3
    (problem,) = recipes.pool_problems(config, groups(broken))
    assert problem.startswith("decode pool: not enough decode_node: 4 workers x 1 = 4")

    broken = copy.deepcopy(docs)
    prefill = kind(broken, "RayCluster")["spec"]["workerGroupSpecs"][0]
    prefill["rayStartParams"]["resources"] = '"{\\"prefil_node\\": 1}"'
    (problem,) = recipes.pool_problems(config, groups(broken))
    assert "not enough prefill_node" in problem

    broken = copy.deepcopy(docs)
    prefill = kind(broken, "RayCluster")["spec"]["workerGroupSpecs"][0]
    prefill["rayStartParams"]["resources"] = "{prefill_node: 1}"
    prefill["rayStartParams"]["labels"] = "pdserve/pool=prefill"
    del prefill["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    del prefill["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
    problems = recipes.kuberay_problems(broken, config)
    assert any("rayStartParams resources is not a JSON object" in p for p in problems)
    assert any("'labels' is refused" in p for p in problems)

    broken = copy.deepcopy(docs)
    prefill = kind(broken, "RayCluster")["spec"]["workerGroupSpecs"][0]
    del prefill["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    prefill["rayStartParams"]["num-gpus"] = "1"
    assert any("no GPU limit" in p for p in recipes.kuberay_problems(broken, config))
    del prefill["rayStartParams"]["num-gpus"]
    del prefill["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
    (problem,) = recipes.pool_problems(config, groups(broken))
    assert problem.startswith("prefill pool: not enough GPU")

    broken = copy.deepcopy(docs)
    kind(broken, "Service")["spec"]["ports"][0]["targetPort"] = 8080
    assert recipes.kuberay_problems(broken, config) == [
        "no Service port targets the router's http_port 8000"]
    loopback = ClusterConfig.from_dict({**yaml.safe_load(kind(docs, "ConfigMap")["data"][
        "pdserve.yaml"]), "host": "127.0.0.1"})
    assert "no Service can reach the router" in recipes.kuberay_problems(docs, loopback)[0]


# ---------------------------------------------------------------- docs/deploy.md

def _doc_commands(prog: str) -> list[list[str]]:
    """Command lines in docs/deploy.md's code blocks that run ``prog`` (continuation
    lines joined, leading VAR=value assignments dropped)."""
    blocks: list[list[str]] = []
    lang = None
    for line in DEPLOY_MD.read_text().splitlines():
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
            if lang in ("bash", "sh", ""):
                blocks.append([])
            continue
        if lang in ("bash", "sh", ""):
            blocks[-1].append(line)
    out: list[list[str]] = []

    def scan(tokens: list[str]) -> None:
        for i, tok in enumerate(tokens):
            if " " in tok:  # a quoted command: `ray exec ... 'a; pdserve bench ...'`
                scan(shlex.split(tok))
            elif tok == prog and (i == 0 or tokens[i - 1].endswith(";")
                                  or re.fullmatch(r"[A-Z_]+=\S*", tokens[i - 1])):
                argv = []
                for arg in tokens[i + 1:]:
                    if arg in ("&&", "||", "|", "&"):
                        break
                    argv.append(arg.removesuffix(";"))
                    if arg.endswith(";"):
                        break
                out.append(argv)

    for block in blocks:
        for line in "\n".join(block).replace("\\\n", " ").splitlines():
            scan(shlex.split(line, comments=True))
    return out


def test_docs_pdserve_commands_parse() -> None:
    parser = build_parser()
    commands = _doc_commands("pdserve")
    assert commands, "docs/deploy.md shows pdserve commands"
    for argv in commands:
        args = parser.parse_args(argv)  # SystemExit on a flag that does not exist
        if args.command == "serve" and args.config:
            assert (ROOT / args.config).is_file()
    text = DEPLOY_MD.read_text()
    for path in re.findall(r"`((?:deploy|docs)/[\w./-]+\.(?:yaml|yml|sh|md|json))`", text):
        assert (ROOT / path).exists(), path


def test_docs_ray_commands_parse() -> None:
    commands = _doc_commands("ray")
    assert {"up", "exec", "dashboard", "attach", "start", "logs"} <= {
        ray_cli_parse(argv) for argv in commands}
    for argv in commands:
        if argv[0] in ("up", "exec", "dashboard", "attach"):  # CLUSTER_CONFIG_FILE first
            assert next(a for a in argv[1:] if not a.startswith("-")) == "deploy/ray/cluster.yaml"


def test_docs_ray_start_lines_match_the_recipe() -> None:
    from ray._private.label_utils import parse_node_labels_string

    starts = [a for a in _doc_commands("ray") if a[:1] == ["start"] and "--head" not in a]
    assert len(starts) == 2
    cluster = launcher()
    for argv in starts:
        res, labels = recipes._start_flags([shlex.join(["ray", *argv])])
        (pool,) = [p for p in POOLS if f"{p}_node" in res]
        assert res == {f"{pool}_node": cluster["available_node_types"][pool]["resources"][
            f"{pool}_node"]}
        flag = next(a for a in argv if a.startswith("--labels="))
        assert parse_node_labels_string(flag.split("=", 1)[1]) == labels \
            == cluster["available_node_types"][pool]["labels"]
