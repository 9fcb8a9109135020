#!/usr/bin/env bash
# Submit `pdserve serve` to a running Ray cluster as a Ray job (docs/deploy.md).
#
#   deploy/ray/job.sh [--dry-run] [more `pdserve serve` flags...]
#
# The job runs on the head node, where it joins the cluster (`--address auto`) and
# starts the pools of deploy/ray/pdserve.yaml on the worker nodes. Its working_dir
# is this checkout without the pdserve package itself (every node runs the pdserve
# installed by cluster.yaml's setup; uploading the package would shadow it in the
# workers), so the config is read from what you have here now.
#
# Environment:
#   RAY_ADDRESS     the cluster's dashboard (default http://127.0.0.1:8265, where
#                   `ray dashboard deploy/ray/cluster.yaml` forwards it)
#   PDSERVE_CONFIG  the pdserve config, relative to the repository root
#                   (default deploy/ray/pdserve.yaml)
#   UCX_TLS, UCX_NET_DEVICES   when set here, passed to the job's processes (they
#                   override what the nodes were started with)
#   RAY_AUTH_MODE   default token (the cluster's token is in ~/.ray/auth_token)
#
# --dry-run prints the `ray job submit` command instead of running it.
set -euo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi

cd "$(dirname "$0")/../.."   # the repository root: the job's working_dir
config="${PDSERVE_CONFIG:-deploy/ray/pdserve.yaml}"
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
if [[ ! -f "$config" ]]; then
  echo "job.sh: no config at $config" >&2
  exit 2
fi

env_vars='"NIXL_LOG_LEVEL": "WARN"'
for var in UCX_TLS UCX_NET_DEVICES; do
  if [[ -n "${!var:-}" ]]; then
    env_vars+=", \"$var\": \"${!var}\""
  fi
done
runtime_env="{\"working_dir\": \".\", \"excludes\": [\"/pdserve/\", \"/tests/\", \"/.git/\"], \"env_vars\": {$env_vars}}"

cmd=(ray job submit --address "$address" --runtime-env-json "$runtime_env" --no-wait --
     pdserve serve --address auto --config "$config" "$@")

if (( dry_run )); then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
exec "${cmd[@]}"
