"""A recipe gains keys over time: what an earlier version wrote (an output, checkpoints, an offline capture) still counts
as the same recipe's when the keys it lacks are at their defaults, and not when one of them is not."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from draftsmith.proposers.core.errors import InputError
from draftsmith.training.common import check_output_dir
from draftsmith.training.recipe import CONFIG_FILE, RUNTIME_KEYS, TrainConfig, check_resumable, load_config

from tiny_recipe import REPO


def written_before_chat_format(cfg: TrainConfig) -> dict:
    saved = dataclasses.asdict(cfg)
    del saved["data"]["chat_format"]  # the key a later version added
    return saved


@pytest.mark.parametrize("chat_format, same", [("auto", True), ("sharegpt", False)])
def test_an_output_and_checkpoints_written_before_a_key_existed(chat_format, same, tmp_path):
    cfg = load_config(REPO / "recipes" / "training" / "eagle3_demo.yaml", [f"data.chat_format={chat_format}"])
    out, checkpoint = tmp_path / "out", tmp_path / "run" / "checkpoints" / "step_100"
    for directory in (out, checkpoint):
        directory.mkdir(parents=True)
        (directory / CONFIG_FILE).write_text(yaml.safe_dump(written_before_chat_format(cfg)))
    recipe, defaults = dataclasses.asdict(cfg), dataclasses.asdict(TrainConfig())
    if same:
        check_output_dir(out, recipe, RUNTIME_KEYS, False, defaults)
        check_resumable(cfg, tmp_path / "run")
        return
    with pytest.raises(InputError, match=r"another recipe's output \(differing keys: \['data.chat_format'\]\)"):
        check_output_dir(out, recipe, RUNTIME_KEYS, False, defaults)
    with pytest.raises(InputError, match=r"different recipe \(differing keys: \['data.chat_format'\]\)"):
        check_resumable(cfg, tmp_path / "run")
