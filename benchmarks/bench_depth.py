"""The demo's rows against a deeper target with the same function: what the draft / target cost ratio does to the ranking.

The demo target has 8 layers, so one draft layer costs about a fifth of a target step;
the literature's targets have 32-80. This script pads the target with decoder layers
whose output projections (``o_proj``, ``down_proj``) are zero: each padded layer runs
every op of a real one (its q / k / v, gate / up and attention read copies of the last
layer's weights, and it fills a KV cache of its own), but adds exactly zero to the
residual stream. The padded target therefore computes the same logits and the same
final and intermediate hidden states as the shipped one (checked here, bit for bit),
every head keeps its acceptance, and only what a target step costs changes. Each depth
is a real ``save_pretrained`` directory evaluated by ``draftsmith eval``'s own
``evaluate``, with the demo's own rows (``verify.evaluation.demo``: ``DEMO_PROPOSERS`` and the
shipped heads); EAGLE heads are copied with the padded layer count in their config.

    python -m benchmarks.bench_depth [--target recipes/models/demo_target] [--depths 8,16,24,32]
        [--domains prose,code] [--prompts 8] [--new-tokens 64] [--output outputs/bench/depth] [--json FILE]
    python -m benchmarks.bench_depth --report FILE   # the tables of an earlier run

Greedy outputs must be identical to plain decoding at every depth, and every method's
tau the same at every depth (same function, same drafts): both are checked.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from draftsmith.proposers.core.models import load_causal_lm
from draftsmith.training.demo.run import heldout_documents
from draftsmith.verify.evaluation.demo import DEMO_PROPOSERS, build_domains, trained_drafts
from draftsmith.verify.evaluation.evaluate import EvalConfig, evaluate

ZEROED = ("self_attn.o_proj", "mlp.down_proj")  # the projections that write into the residual stream


def padded_target(target_dir: Path, depth: int, out_dir: Path) -> Path:
    """``target_dir``'s model with layers appended up to ``depth``, each adding zero to the residual; saved with its tokenizer."""
    model = load_causal_lm(target_dir, "target", dtype=torch.float32)  # the project's loader: a bad directory is one line
    layers = model.config.num_hidden_layers
    state = model.state_dict()
    config = model.config
    config.num_hidden_layers = depth
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[0]] * depth
    deeper = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    last = f"model.layers.{layers - 1}."
    for index in range(layers, depth):
        for name, tensor in list(state.items()):
            if name.startswith(last):
                suffix = name.removeprefix(last)
                state[f"model.layers.{index}.{suffix}"] = torch.zeros_like(tensor) if suffix.startswith(ZEROED) else tensor.clone()
    deeper.load_state_dict(state)
    check_same_function(model, deeper, layers)  # before anything is written: no directory of a wrong target is left behind
    out = out_dir / f"target_L{depth}"
    deeper.save_pretrained(out)
    for path in target_dir.iterdir():
        if path.suffix in (".json", ".jinja") and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, out / path.name)
    return out


@torch.no_grad()
def check_same_function(shallow, deep, layers: int) -> None:
    """The padded model's logits and hidden states 0..layers equal the shipped model's, bit for bit (a random sequence)."""
    ids = torch.randint(3, shallow.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    a = shallow(ids, output_hidden_states=True)
    b = deep(ids, output_hidden_states=True)
    assert torch.equal(a.logits, b.logits), "the padded target's logits differ"
    for i in range(layers):  # the last entry of each tuple is the final normed state, compared by the logits
        assert torch.equal(a.hidden_states[i], b.hidden_states[i]), f"hidden state {i} differs"


def padded_heads(proposers: dict[str, dict], depth: int, out_dir: Path) -> dict[str, dict]:
    """The proposer configs, every head that names its target's layer count (EAGLE, DFlash) copied with the padded one.

    The padded layers come after the shipped ones and add nothing, so the layers a head
    reads keep their ids and their states; only the count it checks the target against moves.
    """
    out = {}
    for name, config in proposers.items():
        config = dict(config)
        model = Path(config.get("model", ""))
        values = json.loads((model / "config.json").read_text()) if (model / "config.json").is_file() else {}
        sections = [v for k, v in values.items() if k.startswith("draftsmith_") and isinstance(v, dict) and "target_num_layers" in v]
        if sections:
            copy = out_dir / f"{model.name}_L{depth}"
            shutil.copytree(model, copy, dirs_exist_ok=True)
            for section in sections:
                section["target_num_layers"] = depth
            if "num_target_layers" in values:  # DFlash's copy for vLLM
                values["num_target_layers"] = depth
            (copy / "config.json").write_text(json.dumps(values, indent=1) + "\n")
            config["model"] = str(copy)
        out[name] = config
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="recipes/models/demo_target")
    parser.add_argument("--depths", default="8,16,24,32")
    parser.add_argument("--domains", default="prose,code")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output", default="outputs/bench/depth")
    parser.add_argument("--json", default=None)
    parser.add_argument("--report", default=None, help="print the tables of an earlier run's --json file, and nothing else")
    args = parser.parse_args()
    if args.report:
        report(*from_json(args.report))
        return
    target_dir, out_dir = Path(args.target), Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        raise SystemExit(f"--depths must be comma-separated layer counts, such as 8,16,24, got {args.depths!r}") from None
    shipped_depth = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
    if min(depths) < shipped_depth:
        raise SystemExit(f"--depths: {min(depths)} is below the target's {shipped_depth} layers")
    names = args.domains.split(",")
    written = build_domains(heldout_documents(target_dir), out_dir / "domains", args.prompts, 4 * args.prompt_tokens, 0)
    unknown = [n for n in names if n not in written]
    if unknown:
        raise SystemExit(f"--domains: {unknown} are not demo domains ({sorted(written)})")
    base = {**DEMO_PROPOSERS, **trained_drafts(target_dir)}
    results: dict[int, dict] = {}
    for depth in depths:
        target = target_dir if depth == shipped_depth else padded_target(target_dir, depth, out_dir)
        config = EvalConfig(
            target=str(target),
            domains={n: written[n] for n in names},
            proposers=base if depth == shipped_depth else padded_heads(base, depth, out_dir),
            num_prompts=args.prompts,
            prompt_tokens=args.prompt_tokens,
            max_new_tokens=args.new_tokens,
            peers=False,
            output_dir=str(out_dir / f"eval_L{depth}"),
            threads=1,
        )
        summary = evaluate(config, progress=False)
        results[depth] = {(row["domain"], row["method"]): row for row in summary["rows"]}
    if args.json:  # written before the checks in ``report``: a failed check keeps the measurements it failed on
        rows = [{"depth": d, **row} for d, table in results.items() for row in table.values()]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    report(results, names)


def report(results: dict[int, dict], domains: list[str]) -> None:
    """Speedups per method and depth (median of per-prompt ratios / Spec-Bench's ratio of mean rates), the fastest row, the checks."""
    depths = sorted(results)
    first = results[depths[0]]
    methods = list(dict.fromkeys(m for (_, m) in first))
    for domain in domains:
        print(f"\n{domain}: speedup over plain, median per prompt / Spec-Bench (mean tok/s over plain's); tau in brackets")
        print("| method | " + " | ".join(f"{d} layers" for d in depths) + " |")
        print("|---|" + "---:|" * len(depths))
        for method in methods:
            cells = []
            for d in depths:
                row = results[d][(domain, method)]
                cells.append(f"{row['speedup']:.2f} / {row['speedup_spec_bench']:.2f}x ({row['tau']:.2f})")
            print(f"| {method} | " + " | ".join(cells) + " |")
        for key, label in (("speedup", "median"), ("speedup_spec_bench", "Spec-Bench")):
            best = [max((m for m in methods if m != "plain"), key=lambda m, d=d: results[d][(domain, m)][key]) for d in depths]
            print(f"| fastest ({label}) | " + " | ".join(best) + " |")
    for d in depths:
        for key, row in results[d].items():
            assert row["identical"] == f"{row['prompts']}/{row['prompts']}", f"{d} layers, {key}: {row['identical']} identical to plain"
            assert abs(row["tau"] - first[key]["tau"]) < 1e-9, f"{d} layers, {key}: tau {row['tau']} against {first[key]['tau']}"
    print("\nevery output identical to plain decoding at every depth; every method's tau the same at every depth")


def from_json(path: str) -> tuple[dict[int, dict], list[str]]:
    """The results a ``--json`` file holds, to print their tables again."""
    results: dict[int, dict] = {}
    for row in json.loads(Path(path).read_text()):
        results.setdefault(row["depth"], {})[(row["domain"], row["method"])] = row
    domains = list(dict.fromkeys(domain for table in results.values() for domain, _ in table))
    return results, domains


if __name__ == "__main__":
    main()
