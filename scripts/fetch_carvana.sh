#!/usr/bin/env bash
# Download Carvana's training images and masks into data/imgs and data/masks with the Kaggle CLI.
#
#   scripts/fetch_carvana.sh [DATA_DIR]        # DATA_DIR defaults to data/
#
# Needs (once):
#   1. pip install kaggle                      (not a dependency of this project)
#   2. an API token: kaggle.com → Settings → API → "Create New Token", saved as ~/.kaggle/kaggle.json (chmod 600),
#      or the KAGGLE_USERNAME / KAGGLE_KEY environment variables;
#   3. the competition rules accepted on https://www.kaggle.com/c/carvana-image-masking-challenge/rules
#      (downloads fail with "403 Forbidden" until then).
#
# Result: 5088 images data/imgs/<id>_<nn>.jpg (1918x1280) and masks data/masks/<id>_<nn>_mask.gif (palette GIFs,
# indices 0/1), about 1.3 GB unpacked; train on it with the default mask-suffix detection (CarvanaDataset naming).
# Without Kaggle access, `python -m utils.datasets.synthetic data/` writes a small dataset in the same layout.
set -euo pipefail

data_dir="${1:-data}"
competition="carvana-image-masking-challenge"

if ! command -v kaggle >/dev/null 2>&1; then
    echo "error: the kaggle command is missing; install it with 'pip install kaggle' and add an API token" >&2
    exit 2
fi
for folder in "$data_dir/imgs" "$data_dir/masks"; do
    # Refuse to mix Carvana into an existing dataset (hidden files such as .gitkeep do not count).
    if [ -d "$folder" ] && [ -n "$(find "$folder" -mindepth 1 -maxdepth 1 ! -name '.*' -print -quit)" ]; then
        echo "error: $folder is not empty; move its files away (or pass another DATA_DIR) first" >&2
        exit 2
    fi
done

download_dir="$(mktemp -d "${TMPDIR:-/tmp}/carvana.XXXXXX")"
trap 'rm -rf "$download_dir"' EXIT

for archive in train_hq.zip train_masks.zip; do
    kaggle competitions download -c "$competition" -f "$archive" -p "$download_dir"
    # Older CLI versions wrap single files in <name>.zip.zip or leave them as <name>; unwrap whatever came.
    if [ ! -f "$download_dir/$archive" ] && [ -f "$download_dir/$archive.zip" ]; then
        unzip -q -o "$download_dir/$archive.zip" -d "$download_dir"
    fi
done

mkdir -p "$data_dir/imgs" "$data_dir/masks"
# -j drops the archive's top folder (train_hq/, train_masks/) so the files land directly in imgs/ and masks/.
unzip -q -j "$download_dir/train_hq.zip" -d "$data_dir/imgs"
unzip -q -j "$download_dir/train_masks.zip" -d "$data_dir/masks"

echo "$(find "$data_dir/imgs" -maxdepth 1 -name '*.jpg' | wc -l) images in $data_dir/imgs," \
     "$(find "$data_dir/masks" -maxdepth 1 -name '*_mask.gif' | wc -l) masks in $data_dir/masks"
