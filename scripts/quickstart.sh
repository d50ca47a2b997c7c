#!/usr/bin/env bash
# The README's first command: set up .venv, make demo data if data/ is empty, train briefly, predict a few images.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python

if [ -z "$(find data/imgs -maxdepth 1 -type f ! -name '.*' -print -quit 2>/dev/null)" ]; then
    echo "data/imgs is empty: generating the Carvana-style demo dataset"
    "$PY" -m utils.datasets.synthetic data --n 200 --size 480x320 --seed 0
fi

# A short CPU-sized run; on a GPU the same command just runs faster.
"$PY" train.py --exp_name demo --epochs "${DEMO_EPOCHS:-4}" --batch-size 8 --scale 0.25 --base-channels 16 \
    --learning-rate 3e-3 --validation 10 --classes 2 --wandb disabled --resume auto

mapfile -t samples < <(find data/imgs -maxdepth 1 -type f ! -name '.*' | sort | head -n 8)
"$PY" predict.py --model checkpoints/demo/best.pth --input "${samples[@]}" --output-dir outputs/demo --viz \
    --scale 0.25
"$PY" evaluate.py --model checkpoints/demo/best.pth --imgs data/imgs --masks data/masks --scale 0.25 --batch-size 8 \
    --json outputs/demo/evaluation.json

echo
echo "Done. Checkpoints: checkpoints/demo/  (best.pth, last.pth, metrics.jsonl, curves.png)"
echo "      Predicted masks and overlays: outputs/demo/   Scores: outputs/demo/evaluation.json"
