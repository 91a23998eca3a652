"""VisDrone-DET → YOLO on small fixtures in the real VisDrone-DET layout, checked to the number and by Ultralytics."""

from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

import skyfed
from models.visdrone import CATEGORIES, REASONS, convert, convert_rows, parse_annotation
from models.yolo_dataset import DatasetError, label_file, load_data_yaml, read_labels

# Image A, 200 x 100: one row per case the conversion must handle.
ROWS_A = (
    "10,20,40,30,1,4,0,0\n"  # car → class 3
    "0,0,50,50,0,0,0,0\n"  # ignored region (score 0)
    "100,50,20,10,1,0,0,0\n"  # category 0, scored 1
    "60,10,10,20,1,11,0,0\n"  # others
    "150,60,30,20,1,10,0,1\n"  # motor → class 9, or dropped
    "180,80,40,40,1,1,0,0,\n"  # pedestrian, trailing comma, runs 20 px past the right and bottom edges
    "200,10,15,15,1,2,0,0\n"  # people starting at the right edge: nothing left after clipping
)
LABELS_A_KEEP = [
    [3, 0.15, 0.35, 0.2, 0.3],
    [9, 0.825, 0.7, 0.15, 0.2],
    [0, 0.95, 0.9, 0.1, 0.2],
]
# Image B, 64 x 48: a bus and a bicycle starting 4 px left of the image.
ROWS_B = "8,4,16,12,1,9,0,0\n-4,0,10,10,1,3,1,0\n"
LABELS_B = [[8, 0.25, 20 / 96, 0.25, 0.25], [2, 6 / 128, 10 / 96, 6 / 64, 10 / 48]]
SPLITS = {
    "VisDrone2019-DET-train": {
        "0000001_00001_d_0000001": ((200, 100), ROWS_A),
        "0000002_00003_d_0000005": ((64, 48), ROWS_B),
    },
    "VisDrone2019-DET-val": {"0000003_00001_d_0000001": ((100, 100), "10,10,20,20,1,5,0,0\n")},
    "VisDrone2019-DET-test-dev": {"0000004_00001_d_0000001": ((50, 40), "0,0,10,10,1,6,0,0\n")},
}


def write_split(folder: Path, images: dict) -> None:
    (folder / "images").mkdir(parents=True)
    (folder / "annotations").mkdir()
    for stem, ((width, height), rows) in images.items():
        Image.new("RGB", (width, height), (90, 120, 60)).save(folder / "images" / f"{stem}.jpg", "JPEG")
        (folder / "annotations" / f"{stem}.txt").write_text(rows)


@pytest.fixture
def visdrone(tmp_path) -> Path:
    """A VisDrone root as the official zips extract: VisDrone2019-DET-{train,val,test-dev}/{images,annotations}."""
    root = tmp_path / "VisDrone"
    for name, images in SPLITS.items():
        write_split(root / name, images)
    return root


def assert_ultralytics_accepts(utils, yaml_path: Path, names: tuple[str, ...]) -> None:
    data = utils.check_det_dataset(str(yaml_path))
    assert data["nc"] == len(names) and data["names"] == dict(enumerate(names))
    for image in load_data_yaml(yaml_path).train:
        result = utils.verify_image_label((str(image), str(label_file(image)), "", False, len(names), 0, 0, False))
        assert tuple(result[5:9]) == (0, 1, 0, 0), result[-1]  # label not missing, found, not empty, not corrupt


def test_rows_become_yolo_lines_and_drops_are_counted_by_reason():
    rows = parse_annotation(ROWS_A, "a.txt")
    assert rows.shape == (7, 8)
    labels, reasons = convert_rows(rows, 200, 100, "keep")
    np.testing.assert_allclose(labels, LABELS_A_KEEP, atol=1e-6)
    assert [REASONS[r] for r in reasons] == [
        "kept",
        "ignored region (score 0)",
        "ignored (category 0)",
        "others (category 11)",
        "kept",
        "kept",
        "no area left after clipping to the image",
    ]
    dropped_motor, reasons = convert_rows(rows, 200, 100, "drop")
    np.testing.assert_allclose(dropped_motor, [LABELS_A_KEEP[0], LABELS_A_KEEP[2]], atol=1e-6)
    assert reasons[4] == REASONS.index("motor (--motor drop)")
    labels, reasons = convert_rows(parse_annotation(ROWS_B, "b.txt"), 64, 48)
    np.testing.assert_allclose(labels, LABELS_B, atol=1e-6)
    assert not reasons.any()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1,2,3,4,1,4,0,0\n1,2,3,4,1,4,0\n", "bad.txt line 2: 7 fields"),
        ("1,2,3,4,1,4,0,0,0\n", "bad.txt line 1: 9 fields"),
        ("\n1,2,3.5,4,1,4,0,0\n", "bad.txt line 2: '1,2,3.5,4,1,4,0,0' has a non-integer field"),
        ("1,2,3,4,1,12,0,0\n", "bad.txt line 1: object_category 12 is outside VisDrone's 0..11"),
    ],
)
def test_a_malformed_line_is_an_error_naming_file_and_line(text, message):
    with pytest.raises(DatasetError, match=message):
        parse_annotation(text, "bad.txt")


def test_root_of_splits_converts_with_motor_kept(visdrone, tmp_path, ultralytics_utils):
    dst = tmp_path / "yolo"
    summary = convert(visdrone, dst, "keep")
    assert list(summary.images.items()) == [("train", 2), ("val", 1), ("test", 1)]
    assert summary.objects.tolist() == [1, 0, 1, 1, 1, 1, 0, 0, 1, 1]
    assert summary.dropped == {
        "ignored region (score 0)": 1,
        "ignored (category 0)": 1,
        "others (category 11)": 1,
        "motor (--motor drop)": 0,
        "no area left after clipping to the image": 1,
    }
    assert summary.clipped == 2 and summary.linked == 4 and summary.notes == []
    np.testing.assert_allclose(read_labels(dst / "labels/train/0000001_00001_d_0000001.txt"), LABELS_A_KEEP, atol=1e-6)
    np.testing.assert_allclose(read_labels(dst / "labels/train/0000002_00003_d_0000005.txt"), LABELS_B, atol=1e-6)
    np.testing.assert_allclose(read_labels(dst / "labels/val/0000003_00001_d_0000001.txt"), [[4, 0.2, 0.2, 0.2, 0.2]])
    np.testing.assert_allclose(
        read_labels(dst / "labels/test/0000004_00001_d_0000001.txt"), [[5, 0.1, 0.125, 0.2, 0.25]]
    )
    source = visdrone / "VisDrone2019-DET-train/images/0000001_00001_d_0000001.jpg"
    assert (dst / "images/train/0000001_00001_d_0000001.jpg").stat().st_ino == source.stat().st_ino  # hard link
    document = yaml.safe_load((dst / "data.yaml").read_text())
    assert document == {"train": "images/train", "val": "images/val", "names": list(CATEGORIES), "test": "images/test"}
    assert_ultralytics_accepts(ultralytics_utils, dst / "data.yaml", CATEGORIES)


def test_motor_dropped_gives_the_thesis_nine_classes(visdrone, tmp_path, ultralytics_utils):
    dst = tmp_path / "yolo9"
    summary = convert(visdrone, dst, "drop")
    assert summary.names == CATEGORIES[:9] and "motor" not in summary.names
    assert summary.objects.tolist() == [1, 0, 1, 1, 1, 1, 0, 0, 1]
    assert summary.dropped["motor (--motor drop)"] == 1
    labels = read_labels(dst / "labels/train/0000001_00001_d_0000001.txt")
    np.testing.assert_allclose(labels, [LABELS_A_KEEP[0], LABELS_A_KEEP[2]], atol=1e-6)
    assert yaml.safe_load((dst / "data.yaml").read_text())["names"] == list(CATEGORIES[:9])
    assert_ultralytics_accepts(ultralytics_utils, dst / "data.yaml", CATEGORIES[:9])


def test_one_split_folder_converts_and_val_falls_back_with_a_note(visdrone, tmp_path):
    summary = convert(visdrone / "VisDrone2019-DET-val", tmp_path / "yolo")
    assert summary.images == {"val": 1}
    assert (
        tmp_path / "yolo/labels/val/0000003_00001_d_0000001.txt"
    ).read_text() == "4 0.200000 0.200000 0.200000 0.200000\n"
    assert yaml.safe_load((tmp_path / "yolo/data.yaml").read_text())["train"] == "images/val"
    assert summary.notes == ["no train split in SRC: data.yaml's train is images/val (add VisDrone2019-DET-train)"]


def test_an_image_without_annotation_and_a_used_dst_are_refused(visdrone, tmp_path):
    (visdrone / "VisDrone2019-DET-val/annotations/0000003_00001_d_0000001.txt").unlink()
    with pytest.raises(DatasetError, match="0000003_00001_d_0000001.jpg has no annotation file"):
        convert(visdrone, tmp_path / "yolo")
    (tmp_path / "used").mkdir()
    (tmp_path / "used/keep.txt").write_text("x")
    with pytest.raises(DatasetError, match="is not empty"):
        convert(visdrone, tmp_path / "used")


def test_cli_converts_end_to_end_and_prints_the_summary(visdrone, tmp_path, capsys):
    assert skyfed.main(["data", "visdrone-to-yolo", str(visdrone), str(tmp_path / "yolo"), "--motor", "drop"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"wrote {tmp_path / 'yolo' / 'data.yaml'} (9 classes)"
    assert out[1].startswith("images: train 2, val 1, test 1 (4 hard-linked, 0 copied)")
    assert out[2].startswith("objects: 6 (pedestrian 1, people 0, bicycle 1, car 1, van 1, truck 1,")
    assert out[3] == (
        "dropped rows: 5 (ignored region (score 0) 1, ignored (category 0) 1, others (category 11) 1, "
        "motor (--motor drop) 1, no area left after clipping to the image 1)"
    )


def test_cli_bad_input_exits_2_with_one_line(visdrone, tmp_path, capsys):
    annotation = visdrone / "VisDrone2019-DET-train/annotations/0000002_00003_d_0000005.txt"
    annotation.write_text("8,4,16,12,1,9,0,0\n8,4,x,12,1,9,0,0\n")
    assert skyfed.main(["data", "visdrone-to-yolo", str(visdrone), str(tmp_path / "yolo")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"skyfed data visdrone-to-yolo: {annotation} line 2: '8,4,x,12,1,9,0,0' has a non-integer field"
    assert skyfed.main(["data", "visdrone-to-yolo", str(tmp_path / "nowhere"), str(tmp_path / "y")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_the_older_data_spelling_means_data_digits():
    from sim.data_cli import run_classify_data

    args = skyfed.build_parser().parse_args(skyfed.legacy_spelling(["data", "drone-01", "drone-02", "--out", "x"]))
    assert args.handler is run_classify_data and args.dataset == "digits" and args.agents == ["drone-01", "drone-02"]
    assert skyfed.legacy_spelling(["data", "partition", "d.yaml"]) == ["data", "partition", "d.yaml"]
