#!/usr/bin/env bash
# areal-jax on a Cloud TPU pod slice: the same command on every worker, jax.distributed with the
# pod auto-detected (--distributed). Run from your workstation with gcloud configured:
#
#   launch/tpu_pod.sh TPU_NAME ZONE --gin_file=configs/qwen2_5_1_5b_gsm8k_tpu.gin --run_dir=/mnt/runs/q25
#
# Every worker needs this repository at the same path (AREAL_REMOTE_DIR, default ~/areal_jax;
# e.g. clone it there first with `--command='git clone ...'`), and --run_dir must be a directory
# every worker sees (NFS, or a bucket mounted with gcsfuse). Everything after ZONE goes to
# `areal-jax train`. Each worker builds its .venv (with the TPU build of jax) on first use.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 TPU_NAME ZONE [areal-jax train flags...]" >&2
  exit 2
fi
name=$1 zone=$2
shift 2
remote_dir="${AREAL_REMOTE_DIR:-~/areal_jax}"
# Quoted for the worker's shell; a leading ~/ stays unquoted so that it expands there.
if [[ "$remote_dir" == "~/"* ]]; then cd_to="~/$(printf '%q' "${remote_dir#\~/}")"; else cd_to=$(printf '%q' "$remote_dir"); fi
flags=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all \
  --command="cd $cd_to && AREAL_EXTRAS=tpu source launch/env.sh && areal-jax train --distributed$flags"
