#!/bin/bash
# The GPU checks as one command, for a machine with NVIDIA GPUs that has CUDA torch (and JAX,
# Lightning, transformers) but none of ddptrain's own dependencies and no network.
#
#   bash benchmarks/gpu_session.sh --download   # here, with a package index: wheels into .whl/
#   bash benchmarks/gpu_session.sh [OUTDIR]     # there, from the repository root, .whl/ beside it
#
# The second form installs the wheels into /tmp/site, runs `pytest -m gpu` and then
# `benchmarks/gpu.py`, and writes both logs (and nvidia-smi's view) under OUTDIR (default
# $OUT, else ./gpu-session). It exits non-zero when either fails. Each step has its own time
# limit, so the whole stays under 9 minutes: GPU_TESTS_S and GPU_BENCH_S change them.
set -u -o pipefail
cd "$(dirname "$0")/.."

WHEELS=(paramiko bcrypt cryptography pynacl cffi pycparser invoke)

if [ "${1:-}" = "--download" ]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    platforms=()
    for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
fi

out=${1:-${OUT:-gpu-session}}
mkdir -p "$out"
python=${PYTHON:-python3}
if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_session: no wheels in .whl/: run 'bash benchmarks/gpu_session.sh --download' where pip works" >&2
    exit 2
fi
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.device_count())"; } \
    2>&1 | tee "$out/machine.txt"

# -n 0: the gpu tests share the GPUs; -p no:cacheprovider: the tree may be read-only there.
timeout "${GPU_TESTS_S:-330}" "$python" -m pytest -m gpu -n 0 -p no:cacheprovider -q --timeout 240 tests \
    2>&1 | tee "$out/pytest-gpu.log"
tests=$?
timeout "${GPU_BENCH_S:-180}" "$python" benchmarks/gpu.py --repeats 3 2>&1 | tee "$out/gpu-bench.log"
bench=$?
echo "gpu_session: pytest -m gpu exit $tests, benchmarks/gpu.py exit $bench" | tee -a "$out/machine.txt"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
