"""The demo target pipeline: config, tokenizer, the tiny end-to-end run, resume."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.training.demo.pretrain import build_model, load_config, run
from draftsmith.training.demo.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[3]
QUICK = REPO / "recipes" / "training" / "demo_target_quick.yaml"
TINY = (  # the quick recipe shrunk further so each run takes seconds
    "code_max_mb=0.3 prose_max_mb=0.2 heldout_mod=4 vocab_size=384 hidden_size=32 intermediate_size=64 num_layers=2 "
    "num_heads=2 num_kv_heads=2 block_size=32 batch_size=4 max_steps=6 warmup_steps=2 log_every=2 eval_every=3 "
    "eval_tokens=512 checkpoint_every=3 threads=1"
).split()


def tiny_config(tmp_path: Path, name: str, *overrides: str):
    paths = [f"output_dir={tmp_path / name / 'out'}", f"work_dir={tmp_path / name / 'work'}"]
    return load_config(QUICK, [*TINY, *paths, *overrides])


def test_unknown_key_fails_with_valid_keys(tmp_path):
    with pytest.raises(ValueError, match=r"override 'hiden_size=64' sets unknown key 'hiden_size'; valid keys: .*hidden_size"):
        load_config(QUICK, ["hiden_size=64"])
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("vocab_size: 512\nlayers: 2\n")
    with pytest.raises(ValueError, match=r"\['layers'\].*num_layers"):
        load_config(recipe)
    with pytest.raises(ValueError, match="'num_layers': expected int"):
        load_config(QUICK, ["num_layers=two"])
    with pytest.raises(ValueError, match=r"save_dtype': 'float64' is not one of \['float32', 'bfloat16', 'float16'\]"):
        load_config(QUICK, ["save_dtype=float64"])


def test_overrides_apply_after_the_recipe():
    cfg = load_config(QUICK, ["num_layers=3", "learning_rate=1e-3", "max_minutes=2"])
    assert (cfg.num_layers, cfg.learning_rate, cfg.max_minutes) == (3, 1e-3, 2.0)
    assert cfg.vocab_size == 1024  # from the recipe


def test_tokenizer_round_trips_and_has_chat_template(tmp_path):
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.\n"] * 50
    build_tokenizer(texts, vocab_size=300, model_max_length=64, out_dir=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "def fox(x):\n\treturn x  # ünïcödé, 中文\n"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert {tokenizer.eos_token, tokenizer.pad_token} == {"<|eos|>", "<|pad|>"}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.chat_template
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|bos|><|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n"
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assistant = [i for i, keep in zip(out["input_ids"], out["assistant_masks"], strict=True) if keep]
    assert tokenizer.decode(assistant) == "hello<|end|>"


def test_quick_pipeline_loads_with_auto_classes_and_generates(tmp_path):
    cfg = tiny_config(tmp_path, "quick")
    out = run(cfg)
    names = set(
        "config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json "
        "training_config.yaml loss_curve.json loss_curve.png heldout_loss.json".split()
    )
    assert names <= {p.name for p in out.iterdir()}
    heldout = json.loads((out / "heldout_loss.json").read_text())
    assert set(heldout) == {"code", "prose"} and all(v["nats_per_token"] > 0 for v in heldout.values())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 2
    prompt = tokenizer("def main():", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt.input_ids.shape[1] + 5
    # a second run finds the finished model and skips every stage
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert run(cfg) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_resume_after_interrupt_matches_uninterrupted_run(tmp_path):
    whole = run(tiny_config(tmp_path, "whole", "save_dtype=float32"))
    cfg = tiny_config(tmp_path, "split", "save_dtype=float32")
    with pytest.raises(KeyboardInterrupt):
        run(cfg, interrupt_after_steps=4)  # the interrupt: a checkpoint at step 4, no model
    assert not Path(cfg.output_dir, "model.safetensors").exists()
    resumed = run(cfg)
    expected, actual = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0)
    steps = [p["step"] for p in json.loads((resumed / "loss_curve.json").read_text()) if "train_loss" in p]
    assert steps == [2, 4, 6]
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg, AutoTokenizer.from_pretrained(resumed)).state_dict()
    assert all(not torch.equal(initial[name], actual[name]) for name in actual)  # every parameter trained
