#!/usr/bin/env bash
# The GPU check: moetool's whole test suite on a CUDA machine, then the engine benchmark there.
#
#   bash bench/gpu_check.sh            # suite (pytest-xdist, one worker per core up to 15) + bench/bench.py --gpu
#   OUT=dir bash bench/gpu_check.sh    # where the logs go (default gpu_check/)
#
# Needs: a CUDA GPU, python3 with a CUDA build of torch, pytest, pytest-xdist and pytest-timeout. Packages the
# machine lacks can be brought as wheels in .whl/ (see README "On a GPU"); they are installed without an index.
# Writes: $OUT/env.txt, $OUT/suite.txt (pytest's summary, every failure with its line), $OUT/junit.xml,
# $OUT/bench.txt (the benchmark's report), bench.csv, bench.log (its console: progress, errors, exit code). About 6-8
# minutes on one H100 (suite ~3 min with 15 workers, bench --gpu 3-5 min with its CLI section;
# BENCH_ARGS="--gpu --quick" for a shorter one, BENCH=0 for none).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
export MOETOOL_TEST_DEVICE=${MOETOOL_TEST_DEVICE:-cuda}
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --upgrade .whl/*.whl 2>&1 | grep -v -i warning | tail -3
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -3
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    $PY -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'transformers', transformers.__version__)"
    $PY -c "import kernels; print('kernels', kernels.__version__)" 2>&1 | tail -1
    $PY -c "import lm_eval; print('lm_eval', lm_eval.__version__)" 2>&1 | tail -1
    git rev-parse --short HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
WORKERS=${WORKERS:-$(( $(nproc) < 15 ? $(nproc) : 15 ))}
start=$(date +%s)
timeout "${SUITE_TIMEOUT:-420}" $PY -P -m pytest -n "$WORKERS" -m "not distributed" --timeout 150 -rfE --tb=line -q \
    -p no:cacheprovider --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-} > "$OUT/suite.txt" 2>&1
rc=$?
echo "suite exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/suite.txt"
tail -3 "$OUT/suite.txt"
if [ "${BENCH:-1}" = 1 ]; then
    # the console goes to bench.log: bench.py writes its report to bench.txt itself (<csv stem>.txt), and a redirect
    # into that same file was overwritten by it mid-run (progress lines lost, the report spliced into itself)
    timeout "${BENCH_TIMEOUT:-420}" $PY bench/bench.py ${BENCH_ARGS:---gpu} --csv "$OUT/bench.csv" > "$OUT/bench.log" 2>&1
    echo "bench exit $?" >> "$OUT/bench.log"; tail -25 "$OUT/bench.log"
fi
exit $rc
