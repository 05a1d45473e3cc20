#!/usr/bin/env bash
# Environments of the frameworks whose own code reads what autotune exports for them:
# `autotune export --format verl|openrlhf` (tests/test_rlhf_export_frameworks.py) and
# `--format torchtitan` (tests/test_export_torchtitan.py). Each framework pins packages the
# project's environment does not have or has at another version, so each gets a virtual
# environment of its own:
#
#   tests/envs/frameworks.sh verl|openrlhf|torchtitan [BASE_PYTHON]    prints its python
#
# An environment holds, at exact versions and without their dependencies (`pip --no-deps`),
# the framework and what its configuration checks import that the project's environment lacks
# or has at another version (the RL frameworks' transformers and that release's hub and
# tokenizers; Ray, which verl imports at its top; torchtitan's parser tyro, its SPMD types,
# and Triton, which its llama3 registry imports through its MoE dispatcher's kernels). A
# `.pth` file then puts the project's environment (BASE_PYTHON's, default .venv) behind them,
# read-only, for what both use at any version: torch, numpy, Hydra, torchao. Neither Ray nor
# vLLM runs, no GPU library is installed and no Triton kernel is compiled: the checks compose
# configurations, parse arguments and build models on the meta device.
#
# The environments live in $FRAMEWORK_ENVS (default build/framework-envs, which git ignores),
# one folder per pinned set and project environment: a changed pin builds a new one. A build
# holds a lock, so concurrent test workers build once, and a half-built environment is never
# used.
set -euo pipefail

framework=${1:?usage: tests/envs/frameworks.sh verl|openrlhf|torchtitan [BASE_PYTHON]}
root=$(cd "$(dirname "$0")/../.." && pwd)
base=${2:-$root/.venv/bin/python}

case "$framework" in
verl)
    packages=(
        verl==0.9.1 transformers==5.9.0 huggingface-hub==1.33.0 tokenizers==0.22.2
        httpx==0.28.1 httpcore==1.0.9 ray==2.55.0 protobuf==7.36.2 tensordict==0.10.0
        pyvers==0.2.3 cloudpickle==3.1.3 codetiming==1.4.0 orjson==3.13.0 pillow==13.0.0
    )
    ;;
openrlhf)
    packages=(
        openrlhf==0.11.2 transformers==5.15.0 huggingface-hub==1.33.0 tokenizers==0.22.2
        httpx==0.28.1 httpcore==1.0.9 pylatexenc==2.11
    )
    ;;
torchtitan)
    packages=(
        torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
        spmd-types==0.2.3 torchdata==0.11.0 tensorboard==2.21.0 protobuf==7.36.2
        absl-py==2.5.1 triton==3.9.0
    )
    ;;
*)
    echo "unknown framework $framework: use verl, openrlhf or torchtitan" >&2
    exit 2
    ;;
esac

[[ -x "$base" ]] || { echo "no python at $base: run make install first" >&2; exit 2; }
envs=${FRAMEWORK_ENVS:-$root/build/framework-envs}
# The project's environment the framework's stands before: part of what names the folder.
purelib=$("$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pins=$(printf '%s\n' "${packages[@]}" "$purelib" | sha256sum | cut -c1-12)
env="$envs/$framework-$pins"
python="$env/bin/python"
if [[ -f "$env/.complete" ]]; then
    echo "$python"
    exit 0
fi

mkdir -p "$envs"
exec 9>"$envs/.$framework.lock"
flock 9
if [[ ! -f "$env/.complete" ]]; then
    start=$(date +%s%N)
    rm -rf "$env"
    "$base" -m venv --without-pip "$env"
    # Installed before the project's environment is put behind them: pip sees only the
    # environment's own packages, so it never touches another one's.
    "$base" -m pip --python "$python" install --quiet --disable-pip-version-check \
        --no-deps --only-binary=:all: "${packages[@]}" >&2
    ownlib=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$purelib" >"$ownlib/zz_project_environment.pth"
    printf '%s\n' "${packages[@]}" >"$env/.complete"
    elapsed=$(( ($(date +%s%N) - start) / 100000000 ))
    echo "$framework environment built in $((elapsed / 10)).$((elapsed % 10)) s:" \
        "$env ($(du -sh "$env" | cut -f1))" >&2
fi
echo "$python"
