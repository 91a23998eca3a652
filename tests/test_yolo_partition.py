"""``skyfed data partition``: every train image to exactly one agent, skewed or grouped as asked, reproducibly."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import skyfed
from models.yolo_dataset import DatasetError, class_counts, label_file, load_data_yaml, read_labels, write_data_yaml
from models.yolo_partition import partition_dataset, source_of

NAMES = ("car", "pedestrian", "bus")
SOURCES = 7  # 6 labelled sequences of 5 images, and one of 2 images without labels
TRAIN = 32
PER_CLASS = 10  # train images each class dominates


@pytest.fixture
def dataset(tmp_path) -> Path:
    """32 train images from 7 VisDrone-like sequences; image k has 3 objects of class k % 3 and 1 of the next
    class, so each class dominates exactly 10 images; 2 images have no label file (background)."""
    root = tmp_path / "source"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
    for k in range(30):
        image = root / "images/train" / f"{k // 5 + 1:07d}_{k % 5:05d}_d_{k:07d}.jpg"
        Image.new("RGB", (16, 16), (k, 0, 0)).save(image)
        dominant, other = k % 3, (k + 1) % 3
        rows = [f"{dominant} 0.5 0.5 0.1 0.1"] * 3 + [f"{other} 0.2 0.2 0.1 0.1"]
        label_file(image).write_text("\n".join(rows) + "\n")
    for k in range(2):
        Image.new("RGB", (16, 16)).save(root / "images/train" / f"0000099_{k:05d}_d_0000000.jpg")
    for k in range(3):
        image = root / "images/val" / f"0000050_{k:05d}_d_0000000.jpg"
        Image.new("RGB", (16, 16)).save(image)
        label_file(image).write_text(f"{k} 0.5 0.5 0.2 0.2\n")
    return write_data_yaml(root, NAMES)


def dominant_share(images: tuple[Path, ...], cls: int) -> float:
    dominant = [np.bincount(read_labels(label_file(i))[:, 0].astype(int), minlength=3).argmax() for i in images]
    return float(np.mean(np.array(dominant) == cls))


@pytest.mark.parametrize("scheme", ["uniform", "class-skew", "class-skew:0.5", "by-source"])
def test_every_train_image_goes_to_exactly_one_agent(dataset, tmp_path, scheme, ultralytics_utils):
    partition = partition_dataset(dataset, 3, scheme, tmp_path / "agents", seed=4)
    source = load_data_yaml(dataset)
    assert [shard.name for shard in partition.shards] == ["agent-01", "agent-02", "agent-03"]
    given = [image for shard in partition.shards for image in shard.images]
    assert len(given) == len(set(given)) == TRAIN and set(given) == set(source.train)
    total = np.sum([shard.counts for shard in partition.shards], axis=0)
    assert total.tolist() == class_counts(source.train, 3).tolist() == [40, 40, 40]
    for shard in partition.shards:
        agent = load_data_yaml(shard.yaml_path)
        assert agent.train == shard.images and agent.val == source.val and agent.names == NAMES
        assert shard.counts.tolist() == class_counts(shard.images, 3).tolist()
        data = ultralytics_utils.check_det_dataset(str(shard.yaml_path))
        assert data["nc"] == 3 and data["names"] == dict(enumerate(NAMES))
    if scheme == "uniform":
        assert sorted(len(shard.images) for shard in partition.shards) == [10, 11, 11]


@pytest.mark.parametrize("dominance", [0.5, 0.8, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_class_skew_gives_each_agent_mostly_its_own_class(dataset, tmp_path, dominance, seed):
    """Agents of 11, 11 and 10 images each ask for round(DOMINANCE * size) images of their own class, of which
    there are 10: the share is at least DOMINANCE, or 10/11 when that asks for more; uniform gives about 10/32."""
    partition = partition_dataset(dataset, 3, f"class-skew:{dominance}", tmp_path / "agents", seed=seed)
    assert sorted(shard.skew_class for shard in partition.shards) == sorted(NAMES)
    for shard in partition.shards:
        assert dominant_share(shard.images, NAMES.index(shard.skew_class)) >= min(dominance, PER_CLASS / 11)


def test_by_source_keeps_every_sequence_whole(dataset, tmp_path):
    partition = partition_dataset(dataset, 3, "by-source", tmp_path / "agents", seed=2)
    owners = {}
    for shard in partition.shards:
        for image in shard.images:
            assert owners.setdefault(source_of(image), shard.name) == shard.name
    assert len(owners) == SOURCES
    assert sorted(len(shard.images) for shard in partition.shards) == [10, 10, 12]  # 5+5, 5+5, 5+5+2


def test_same_seed_same_split_and_another_seed_another(dataset, tmp_path):
    def split(seed: int, out: str) -> list[tuple[Path, ...]]:
        return [shard.images for shard in partition_dataset(dataset, 4, "uniform", tmp_path / out, seed).shards]

    assert split(7, "a") == split(7, "b")
    assert split(7, "a2") != split(8, "c")


def test_copy_writes_a_self_contained_dataset(dataset, tmp_path):
    partition = partition_dataset(dataset, 2, "uniform", tmp_path / "agents", seed=0, copy=True)
    for shard in partition.shards:
        folder = tmp_path / "agents" / shard.name
        agent = load_data_yaml(shard.yaml_path)
        assert agent.root == folder and len(agent.train) == len(shard.images) and len(agent.val) == 3
        assert {image.name for image in agent.train} == {image.name for image in shard.images}
        assert class_counts(agent.train, 3).tolist() == shard.counts.tolist()


def test_cli_prints_one_line_per_agent_and_a_total(dataset, tmp_path, capsys):
    argv = ["data", "partition", str(dataset), "--agents", "3", "--scheme", "class-skew:0.8", "--out"]
    assert skyfed.main([*argv, str(tmp_path / "agents"), "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["agent-01", "agent-02", "agent-03", "total"]
    assert lines[0].startswith("agent-01: 11 images, ") and ", skewed toward " in lines[0]
    assert lines[3] == (
        "total: 32 images, 120 objects (car 40, pedestrian 40, bus 40) over 3 agents; "
        "each agent's val: the 3 val images"
    )
    assert skyfed.main([*argv, str(tmp_path / "again"), "--seed", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == lines


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--agents", "0", "--scheme", "uniform"], "--agents 0: give at least 1 agent"),
        (["--agents", "33", "--scheme", "uniform"], "--agents 33 is more than the 32 train images"),
        (["--agents", "8", "--scheme", "by-source"], "--agents 8 but the train images come from only 7 sources"),
        (["--agents", "2", "--scheme", "class-skew:1.5"], "DOMINANCE must be a number in (0, 1]"),
        (["--agents", "2", "--scheme", "class-skew:x"], "DOMINANCE must be a number in (0, 1]"),
        (["--agents", "2", "--scheme", "dirichlet"], "--scheme 'dirichlet': use uniform, class-skew"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(dataset, tmp_path, capsys, flags, message):
    argv = ["data", "partition", str(dataset), *flags, "--out", str(tmp_path / "agents")]
    assert skyfed.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("skyfed data partition: ") and message in err
    assert not (tmp_path / "agents").exists()


def test_a_used_out_folder_is_refused(dataset, tmp_path):
    (tmp_path / "agents/agent-09").mkdir(parents=True)
    with pytest.raises(DatasetError, match="--out .* is not empty"):
        partition_dataset(dataset, 2, "uniform", tmp_path / "agents")
