#!/usr/bin/env bash
# The README's first command: set up .venv, make demo data if data/ is empty, train briefly, then score the model and
# draw its predictions on held-out test images that training never sees.
#
# Rerunning it continues: DEMO_EPOCHS=8 after a 4-epoch run trains epochs 5..8 as a new run from the previous weights
# (--load); a run stopped half-way is resumed; with other images in data/imgs (your own) it trains a new model in a
# new run folder. Each case is said in one line (scripts/quickstart_plan.py decides).
#
# Settings (environment): DEMO_EPOCHS (4). For tests and small machines: QUICKSTART_ROOT (the folder that holds
# data/, checkpoints/ and outputs/; default the repository), DEMO_IMAGES (200), DEMO_VIEWS (views per demo car, 16 as
# in Carvana), DEMO_TEST_IMAGES (32, 4 views per car: 8 test cars), DEMO_SIZE (480x320), DEMO_BASE_CHANNELS (16),
# DEMO_BATCH_SIZE (8), QUICKSTART_SETUP=0 to use .venv as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${QUICKSTART_SETUP:-1}" != 0 ]; then
    bash scripts/setup_env.sh
fi
PY=.venv/bin/python
prefix="${QUICKSTART_ROOT:+${QUICKSTART_ROOT%/}/}"
DATA="${prefix}data"
CHECKPOINTS="${prefix}checkpoints"
EPOCHS="${DEMO_EPOCHS:-4}"
BATCH="${DEMO_BATCH_SIZE:-8}"
SIZE="${DEMO_SIZE:-480x320}"

has_images() { [ -n "$(find "$1" -maxdepth 1 -type f ! -name '.*' -print -quit 2>/dev/null)" ]; }

if ! has_images "$DATA/imgs"; then
    echo "$DATA/imgs is empty: generating the Carvana-style demo dataset"
    "$PY" -m utils.datasets.synthetic "$DATA" --n "${DEMO_IMAGES:-200}" --size "$SIZE" --seed 0 \
        --views "${DEMO_VIEWS:-16}"
fi
# The test set: other cars (another seed) in a folder of their own; train.py reads data/imgs only.
if ! has_images "$DATA/test/imgs"; then
    echo "$DATA/test/imgs is empty: generating the held-out demo test set"
    "$PY" -m utils.datasets.synthetic "$DATA/test" --n "${DEMO_TEST_IMAGES:-32}" --size "$SIZE" --seed 1 --views 4
fi

# What to train: a new run, the rest of a stopped one, more epochs from the last weights, or nothing (see above).
plan_lines=$("$PY" -m scripts.quickstart_plan --checkpoint-dir "$CHECKPOINTS" --exp-name demo \
    --imgs "$DATA/imgs" --epochs "$EPOCHS")
mapfile -t plan <<< "$plan_lines"
run="${plan[0]}"
[ -z "${plan[1]}" ] || echo "${plan[1]}"
if [ "${#plan[@]}" -gt 2 ]; then
    # A short CPU-sized run; on a GPU the same command just runs faster. --split-by prefix: the views of one car
    # stay on one side of the split (the dataset check advises it for names like these; for names without an _
    # each image is its own group, as with the default split).
    "$PY" train.py "${plan[@]:2}" --checkpoint-dir "$CHECKPOINTS" --imgs "$DATA/imgs" --masks "$DATA/masks" \
        --batch-size "$BATCH" --scale 0.25 --base-channels "${DEMO_BASE_CHANNELS:-16}" --learning-rate 3e-3 \
        --validation 10 --classes 2 --split-by prefix --wandb disabled
fi

out="${prefix}outputs/$(basename "$run")"
# Eight overlays of as many different cars as the test set holds.
mapfile -t samples < <("$PY" -m scripts.quickstart_samples "$DATA/test/imgs" 8)
"$PY" predict.py --model "$run/best.pth" --input "${samples[@]}" --output-dir "$out" --viz --masks "$DATA/test/masks"
"$PY" evaluate.py --model "$run/best.pth" --imgs "$DATA/test/imgs" --masks "$DATA/test/masks" \
    --batch-size "$BATCH" --json "$out/test_evaluation.json"

test_dice=$("$PY" -c 'import json, sys; print(format(json.load(open(sys.argv[1]))["dice"], ".3f"))' \
    "$out/test_evaluation.json")
n_test=$(find "$DATA/test/imgs" -maxdepth 1 -type f ! -name '.*' | wc -l)
echo
echo "Done. Test Dice ${test_dice} on the ${n_test} held-out images of $DATA/test/ (never trained on)."
echo "  Checkpoints, metrics.jsonl, curves.png:          $run/"
echo "  Predicted masks, overlays (truth | prediction):  $out/"
echo "  Test scores:                                     $out/test_evaluation.json"
