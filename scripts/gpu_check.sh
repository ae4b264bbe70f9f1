#!/usr/bin/env bash
# The prepared GPU check (issue 59), for a machine with one CUDA GPU that received a copy of this
# tree and nothing else (no `make setup`, no venv, no network):
#
#   scripts/gpu_check.sh engine|nixl|all [--out DIR]        (also: make gpu-check PART=... OUT=...)
#   (DIR defaults to bench-results/gpu-check)
#
#   engine: python scripts/gpu_check_engine.py --out DIR/engine.json   (parity and decode rates)
#   nixl:   python scripts/gpu_check_nixl.py --out DIR/nixl.json       (KV push VRAM to VRAM)
#
# Each part runs under its own time limit (GPU_CHECK_ENGINE_TIMEOUT_S, default 200 s;
# GPU_CHECK_NIXL_TIMEOUT_S, default 150 s) and writes its own JSON; nothing is merged, and a
# part that did not run writes nothing. Without a CUDA device it prints one line saying it
# skipped and exits 0. Exit status: 0 when every part asked for passed, else 1 (2: usage).
#
# Python: .venv/bin/python where `make setup` made one, else python3 from PATH. The tree is made
# importable without installing it (scripts/tree_pythonpath.py) when `import pdserve` fails.
#
# NIXL: the GPU machine has none, and it travels as wheels in .gpu-wheels/ (gitignored; carried
# only in the nixl part's run, since the wheels are ~56 MiB of the 64 MiB a run may carry):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .gpu-wheels nixl==1.5.1 nixl-cu13==1.5.1
# When `import nixl` fails and .gpu-wheels/ holds wheels, they are installed with
# `pip install --no-deps --no-index --target` into a temporary folder put on PYTHONPATH: the
# machine's own Python is left as it was.
#
# UCX: no UCX_TLS is set; UCX picks its transports (see scripts/gpu_check_nixl.py).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: $0 engine|nixl|all [--out DIR]" >&2; }
part="${1:-}"
shift || true
case "$part" in engine|nixl|all) ;; *) usage; exit 2 ;; esac
out=bench-results/gpu-check
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { usage; exit 2; }; out="$2"; shift 2 ;;
    *) usage; exit 2 ;;
  esac
done

if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi

# One line and exit 0 where there is no GPU: nothing below runs.
reason=$("$py" - <<'EOF' 2>&1
try:
    import torch
except ImportError as exc:
    print(f"torch is not importable ({exc})")
else:
    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
EOF
)
if [ -n "$reason" ]; then
  echo "gpu-check $part skipped: $reason"
  exit 0
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
pypath=()
if ! "$py" -c "import pdserve.kv_transfer" 2>/dev/null; then
  tree=$("$py" scripts/tree_pythonpath.py "$scratch/tree") || exit 1
  pypath+=("$tree")
fi
if [ "$part" != engine ] && ! "$py" -c "import nixl._api" 2>/dev/null; then
  shopt -s nullglob
  wheels=(.gpu-wheels/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -gt 0 ]; then
    echo "gpu-check: installing ${wheels[*]} into a temporary folder"
    PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --disable-pip-version-check --no-deps \
      --no-index --target "$scratch/wheels" "${wheels[@]}" || exit 1
    pypath+=("$scratch/wheels")
  else
    echo "gpu-check: nixl is not importable and .gpu-wheels/ holds no wheel" >&2
  fi
fi
if [ ${#pypath[@]} -gt 0 ]; then
  joined=$(IFS=:; echo "${pypath[*]}")
  export PYTHONPATH="$joined${PYTHONPATH:+:$PYTHONPATH}"
fi

mkdir -p "$out"
status=0
run_part() {  # name, time limit (s), script
  local name=$1 limit=$2 script=$3 rc
  if [ ! -f "$script" ]; then
    echo "gpu-check $name: $script is missing" >&2
    status=1
    return
  fi
  echo "gpu-check $name: $py $script --out $out/$name.json (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$py" "$script" --out "$out/$name.json"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu-check $name: ran past its ${limit}s limit" >&2
  fi
  [ "$rc" -eq 0 ] || { echo "gpu-check $name: failed (exit $rc)" >&2; status=1; }
}
case "$part" in
  engine) run_part engine "${GPU_CHECK_ENGINE_TIMEOUT_S:-200}" scripts/gpu_check_engine.py ;;
  nixl) run_part nixl "${GPU_CHECK_NIXL_TIMEOUT_S:-150}" scripts/gpu_check_nixl.py ;;
  all)
    run_part engine "${GPU_CHECK_ENGINE_TIMEOUT_S:-200}" scripts/gpu_check_engine.py
    run_part nixl "${GPU_CHECK_NIXL_TIMEOUT_S:-150}" scripts/gpu_check_nixl.py ;;
esac
exit "$status"
