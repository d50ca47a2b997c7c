"""What the scripts tell a person, from real runs: where outputs went, the bars' names, legend labels, plurals.

Class names (``train.py --class-names``) travel in the checkpoint's inference record to predict's legends and
evaluate's table and JSON; files without them (older ones, milesial's) still load and show mask values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

import evaluate
import predict
from tests.helpers import make_model, one_error_line, save_checkpoint, tiny_unet
from utils.checkpoint.files import load_checkpoint_file
from utils.checkpoint.format import KEY_INFERENCE, InferenceRecord
from utils.checkpoint.model import load_model
from utils.errors import USER_ERROR_EXIT_CODE, count
from utils.inference.config import PredictConfig
from utils.inference.writer import OutputPlan, class_colours, legend_entries, prediction_summary


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_count_says_one_thing_and_several_things():
    assert count(1, "epoch") == "1 epoch" and count(0, "epoch") == "0 epochs" and count(2, "epoch") == "2 epochs"
    assert count(1, "batch", "batches") == "1 batch" and count(3, "batch", "batches") == "3 batches"


def test_predict_ends_with_the_output_folder_and_the_counts(tmp_path, images, binary_checkpoint, capsys):
    out = tmp_path / "out"
    argv = ["-m", str(binary_checkpoint), "-i", str(images[0].parent), "--output-dir", str(out), "--no-progress"]
    assert predict.main([*argv, "--viz", "-j", "0"]) == 0
    n = len(images)
    assert last_line(capsys.readouterr().out).endswith(f"Wrote {n} masks and {n} overlays ({n} of {n} images) to {out}")
    assert len(list(out.glob("*_OUT.png"))) == n and len(list(out.glob("*_VIZ.png"))) == n

    # One image, masks only, written beside its input: singular nouns and the input's folder.
    assert predict.main(["-m", str(binary_checkpoint), "-i", str(images[0]), "--no-progress", "-j", "0"]) == 0
    assert last_line(capsys.readouterr().out).endswith(f"Wrote 1 mask (1 of 1 image) to {images[0].parent}")


def test_the_summary_names_a_few_folders_and_counts_the_rest():
    plans = [
        OutputPlan(Path(f"out/{name}/{n}_OUT.png"), Path(f"out/{name}/{n}_VIZ.png")) for n, name in enumerate("dcbaee")
    ]
    line = prediction_summary(plans, 1, PredictConfig(viz=True, no_save=True))
    assert line == "Wrote 5 overlays (5 of 6 images) to out/a, out/b, out/c and 2 other folders"
    assert prediction_summary(plans[:1], 0, PredictConfig()) == "Wrote 1 mask (1 of 1 image) to out/d"


def test_evaluate_names_its_json_and_its_bar_says_evaluating(
    self_labelled_masks, carvana_data, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("utils.inference.config.stderr_is_terminal", lambda: True)  # bars are drawn on a terminal only
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 255])
    masks = self_labelled_masks(checkpoint)
    capsys.readouterr()
    report = tmp_path / "scores" / "test.json"
    argv = ["-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(masks), "-s", "1", "-j", "0"]
    # With the bar on, as on a terminal.
    assert evaluate.main([*argv, "--json", str(report)]) == 0
    captured = capsys.readouterr()
    assert last_line(captured.out) == f"Scores written to {report}" and json.loads(report.read_text())["dice"] == 1.0
    assert "Evaluating" in captured.err and "Validation" not in captured.err
    assert f"on 16 images of {carvana_data.imgs}" in captured.out

    assert evaluate.main([*argv, "--no-progress"]) == 0  # no --json: nothing claims a file was written
    assert "written" not in capsys.readouterr().out


def test_legends_name_mask_values_or_class_names():
    grey = class_colours([0, 128, 255])
    assert legend_entries(grey, [0, 128, 255]) == [(grey[1], "value 128"), (grey[2], "value 255")]
    assert legend_entries(grey, [0, 128, 255], ("background", "road", "car")) == [(grey[1], "road"), (grey[2], "car")]
    colour = class_colours([[0, 0, 0], [128, 0, 0]])
    assert legend_entries(colour, [[0, 0, 0], [128, 0, 0]]) == [((128, 0, 0), "value (128, 0, 0)")]


def test_class_names_travel_from_training_to_evaluate_and_old_files_load(runner, carvana_data, tmp_path, capsys):
    assert runner.main("named", "--epochs", "1", "--class-names", "background, car") == 0
    best = runner.run_dir("named") / "best.pth"
    assert InferenceRecord.of(load_checkpoint_file(best)).class_names == ("background", "car")
    assert load_model(best)[1].inference.class_names == ("background", "car")
    capsys.readouterr()

    report = tmp_path / "named.json"
    argv = ["-m", str(best), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks), "--no-progress"]
    assert evaluate.main([*argv, "-j", "0", "--json", str(report)]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^1 +1 +car +\d\.\d{4} +\d\.\d{4}$", table, re.MULTILINE), table
    assert json.loads(report.read_text())["class_names"] == ["background", "car"]

    # A file written before the record had names (and milesial's, which has no record) loads without them.
    payload = load_checkpoint_file(best)
    del payload[KEY_INFERENCE]["class_names"]
    torch.save(payload, tmp_path / "older.pth")
    assert load_model(tmp_path / "older.pth")[1].inference.class_names == ()
    milesial = save_checkpoint(tmp_path / "milesial.pth", tiny_unet(), [0, 1], style="milesial")
    assert load_model(milesial)[1].inference.class_names == ()


def test_a_class_name_count_that_does_not_fit_is_one_error_line(runner, capsys):
    assert runner.main("badnames", "--epochs", "1", "--class-names", "a,b,c") == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    assert "--class-names a,b,c gives 3 name(s) but --classes 2 needs 2" in line
    assert not runner.run_dir("badnames").exists()


def test_training_messages_count_in_the_singular(runner, capsys):
    assert runner.main("plurals", "--epochs", "1") == 0
    out = capsys.readouterr().out
    assert "x 1 process x" in out and "1 CPU thread and" in out
    assert re.search(r"Saved last\.pth.* \(1 epoch and 0 batches done\)", out), out
    assert not re.search(r"\b1 (epochs|CPU threads|processes)\b", out)


def test_evaluate_off_a_terminal_draws_no_bar(self_labelled_masks, carvana_data, tmp_path, capsys):
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 255])
    masks = self_labelled_masks(checkpoint)
    capsys.readouterr()
    argv = ["-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(masks), "-s", "1", "-j", "0"]
    assert evaluate.main(argv) == 0  # capsys's stderr is no terminal, as a job's log file is not
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "Evaluating" not in captured.err
    assert f"on 16 images of {carvana_data.imgs}" in captured.out
