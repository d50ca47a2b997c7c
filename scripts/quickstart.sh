#!/usr/bin/env bash
# The README's first command: set up .venv, make demo data if data/ is empty, train briefly, then score the model and
# draw its predictions on held-out test images that training never sees.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python

has_images() { [ -n "$(find "$1" -maxdepth 1 -type f ! -name '.*' -print -quit 2>/dev/null)" ]; }

if ! has_images data/imgs; then
    echo "data/imgs is empty: generating the Carvana-style demo dataset"
    "$PY" -m utils.datasets.synthetic data --n 200 --size 480x320 --seed 0
fi
# The test set: other cars (another seed) in a folder of their own; train.py reads data/imgs only.
if ! has_images data/test/imgs; then
    echo "data/test/imgs is empty: generating the held-out demo test set"
    "$PY" -m utils.datasets.synthetic data/test --n 32 --size 480x320 --seed 1
fi

# A short CPU-sized run; on a GPU the same command just runs faster.
"$PY" train.py --exp_name demo --epochs "${DEMO_EPOCHS:-4}" --batch-size 8 --scale 0.25 --base-channels 16 \
    --learning-rate 3e-3 --validation 10 --classes 2 --wandb disabled --resume auto

mapfile -t samples < <(find data/test/imgs -maxdepth 1 -type f ! -name '.*' | sort | head -n 8)
"$PY" predict.py --model checkpoints/demo/best.pth --input "${samples[@]}" --output-dir outputs/demo --viz \
    --masks data/test/masks
"$PY" evaluate.py --model checkpoints/demo/best.pth --imgs data/test/imgs --masks data/test/masks \
    --batch-size 8 --json outputs/demo/test_evaluation.json

test_dice=$("$PY" -c 'import json, sys; print(format(json.load(open(sys.argv[1]))["dice"], ".3f"))' \
    outputs/demo/test_evaluation.json)
n_test=$(find data/test/imgs -maxdepth 1 -type f ! -name '.*' | wc -l)
echo
echo "Done. Test Dice ${test_dice} on the ${n_test} held-out images of data/test/ (never trained on)."
echo "  Checkpoints, metrics.jsonl, curves.png:          checkpoints/demo/"
echo "  Predicted masks, overlays (truth | prediction):  outputs/demo/"
echo "  Test scores:                                     outputs/demo/test_evaluation.json"
